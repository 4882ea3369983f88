"""gRPC translation for canteen.v1.Scheduler."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from canteen.codec import request_from_pb, response_to_pb
from canteen.finish import Finish
from canteen.plan import MAX_STREAM_INTERVAL
from canteen.tracing import context_from_metadata
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler.service import (
    InvalidRequestError,
    NoWorkerError,
    QueueFullError,
    SchedulerService,
    SequenceRefusedError,
    WorkerFailedError,
)
from scheduler.subscriptions import Subscription, SubscriptionError

STATUS_OF = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    NoWorkerError: grpc.StatusCode.UNAVAILABLE,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerFailedError: grpc.StatusCode.UNAVAILABLE,
    SequenceRefusedError: grpc.StatusCode.INTERNAL,  # the plan broke an invariant
}


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self._service = service

    async def Generate(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.ScheduleResponse]:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        params = request_from_pb(request, context.time_remaining())
        try:
            feed = self._feed(request, context.peer())
            trace_context = context_from_metadata(context.invocation_metadata())
            events = self._service.generate(params, trace_context, feed)
            if feed is not None:  # tokens and the final message go on the subscription
                finish = None
                async for event in events:
                    finish = event.finish
                if finish is Finish.CANCELLED and feed[0].is_closed:
                    await context.abort(
                        grpc.StatusCode.CANCELLED,
                        f"subscription_id {feed[0].id!r} closed; the request was cancelled",
                    )
                return
            is_first = True
            async for event in events:
                yield response_to_pb(event, is_first)
                is_first = False
        except SubscriptionError as exc:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                str(exc),
                (("canteen-final", "1"), ("canteen-subscription", "refused")),
            )
        except tuple(STATUS_OF) as exc:
            # The scheduler's own verdict: the gateway does not retry it as if unreachable.
            await context.abort(STATUS_OF[type(exc)], str(exc), (("canteen-final", "1"),))

    def _feed(
        self, request: scheduler_pb2.ScheduleRequest, peer: str
    ) -> tuple[Subscription, int, int] | None:
        interval = request.stream_interval
        if not 0 <= interval <= MAX_STREAM_INTERVAL:
            raise InvalidRequestError(
                f"stream_interval={interval}: must be in 0..{MAX_STREAM_INTERVAL}"
            )
        if not request.subscription_id:
            if request.stream_tag:
                raise InvalidRequestError("stream_tag needs subscription_id")
            return None
        if not request.stream_tag:
            raise InvalidRequestError("stream_tag is required with subscription_id")
        subscription = self._service.subscriptions.get(request.subscription_id, peer)
        return subscription, request.stream_tag, max(interval, 1)

    async def Subscribe(
        self, request: scheduler_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.ScheduleBatch]:
        subscription = self._service.subscriptions.open(context.peer())
        try:
            yield scheduler_pb2.ScheduleBatch(subscription_id=subscription.id)
            while True:
                batch = await subscription.next_batch()
                yield scheduler_pb2.ScheduleBatch(
                    responses=[response_to_pb(event, first, tag) for tag, event, first in batch]
                )
        finally:
            self._service.subscriptions.close(subscription)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStatsResponse:
        workers = []
        for link in self._service.pool.links.values():
            core, d = link.core, link.desc
            workers.append(
                scheduler_pb2.WorkerStats(
                    worker_id=d.worker_id,
                    address=d.address,
                    model=d.model,
                    version=d.version,
                    num_total_blocks=core.pool.num_blocks,
                    num_free_blocks=core.pool.num_free,
                    num_running=len(core.running),
                    num_waiting=len(core.waiting),
                    num_steps=core.num_steps,
                    is_ready=link.is_ready,
                    num_preemptions=core.num_preemptions,
                    num_cached_blocks=core.pool.num_cached,
                    prefix_cache_hit_rate=core.prefix_cache_hit_rate,
                    num_draft_tokens=core.speculation.num_draft_tokens,
                    num_accepted_tokens=core.speculation.num_accepted_tokens,
                    block_map=core.pool.state_map(),
                    running=[
                        scheduler_pb2.RunningSequence(
                            request_id=seq.request_id,
                            seq_id=seq.seq_id,
                            num_prompt_tokens=len(seq.prompt_ids),
                            num_output_tokens=len(seq.output_ids),
                            num_blocks=len(seq.block_ids),
                            is_decoding=seq.is_decoding,
                        )
                        for seq in sorted(core.running, key=lambda s: s.admit_order)
                    ],
                    last_batch_size=link.last_batch_size,
                )
            )
        refused = [
            scheduler_pb2.RefusedWorker(worker_id=e.worker_id, address=e.address, reason=reason)
            for e, reason in self._service.pool.refused.values()
        ]
        return scheduler_pb2.GetStatsResponse(workers=workers, refused_workers=refused)
