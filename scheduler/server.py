"""gRPC translation for canteen.v1.Scheduler."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

import grpc
import structlog

from canteen.codec import batch_to_pb, request_from_pb, response_to_pb
from canteen.codec.fields import to_pb
from canteen.finish import Finish
from canteen.plan import MAX_STREAM_INTERVAL
from canteen.tracing import context_from_metadata, context_from_traceparent
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler.mux import Connection, DeadlineError, DuplicateTagError, InFlight
from scheduler.service import (
    AdapterNotServedError,
    InvalidRequestError,
    NoWorkerError,
    QueueFullError,
    SchedulerService,
    SequenceRefusedError,
    WorkerFailedError,
)
from scheduler.stats import pool_stats
from scheduler.subscriptions import Subscription, SubscriptionError

STATUS_OF = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    AdapterNotServedError: grpc.StatusCode.FAILED_PRECONDITION,
    NoWorkerError: grpc.StatusCode.UNAVAILABLE,
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerFailedError: grpc.StatusCode.UNAVAILABLE,
    SequenceRefusedError: grpc.StatusCode.INTERNAL,  # the plan broke an invariant
}


class Drain(Protocol):
    """What the servicer reads of the server's drain (``canteen.server.ServiceRuntime``)."""

    @property
    def is_draining(self) -> bool: ...
    @property
    def in_flight(self) -> InFlight: ...


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService, drain: Drain | None = None) -> None:
        self._service = service
        self._drain = drain
        self.local_socket = ""  # where Connect also runs (canteen/local_socket.py); "": nowhere

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
        interval = _interval(request)
        if not request.subscription_id:
            if request.stream_tag:
                raise InvalidRequestError("stream_tag needs subscription_id")
            return None
        if not request.stream_tag:
            raise InvalidRequestError("stream_tag is required with subscription_id")
        subscription = self._service.subscriptions.get(request.subscription_id, peer)
        return subscription, request.stream_tag, interval

    async def Subscribe(
        self, request: scheduler_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.ScheduleBatch]:
        subscription = self._service.subscriptions.open(context.peer())
        try:
            yield scheduler_pb2.ScheduleBatch(subscription_id=subscription.id)
            while True:
                yield batch_to_pb(await subscription.next_batch())
        finally:
            self._service.subscriptions.close(subscription)

    async def Connect(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ScheduleBatch]:
        batches = self.connect_stream(request_iterator, context.peer())
        async with contextlib.aclosing(batches):
            async for batch in batches:
                if batch.subscription_id:  # the first: where the same stream runs locally
                    batch.local_socket = self.local_socket
                yield batch

    async def connect_stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest], peer: str
    ) -> AsyncGenerator[scheduler_pb2.ScheduleBatch]:
        """The Connect stream, whichever link carries it (gRPC, or the local socket)."""
        subscription = self._service.subscriptions.open(peer)
        in_flight = self._drain.in_flight if self._drain is not None else None
        connection = Connection(subscription, self._service.generate, subscription.fail, in_flight)
        reader = asyncio.create_task(self._read_submits(request_iterator, connection))
        try:
            yield scheduler_pb2.ScheduleBatch(subscription_id=subscription.id)
            while True:
                batch = batch_to_pb(await subscription.next_batch(), packed=True)
                for tag, exc in subscription.take_failures():
                    batch.responses.add(stream_tag=tag, failure=_error_to_pb(exc))
                yield batch
        finally:
            reader.cancel()
            await connection.close()
            self._service.subscriptions.close(subscription)

    async def _read_submits(
        self, requests: AsyncIterator[scheduler_pb2.ConnectRequest], connection: Connection
    ) -> None:
        """Submits, then cancels, as they arrive, until the caller stops sending."""
        async for msg in requests:
            for submit in msg.submits:
                self._submit(submit, connection)
            for tag in msg.cancels:
                connection.cancel(tag)

    def _submit(self, submit: scheduler_pb2.SubmitRequest, connection: Connection) -> None:
        request = submit.request
        tag = request.stream_tag
        if not tag:
            return  # an entry could not name it; the caller's own bug
        if self._drain is not None and self._drain.is_draining:
            connection.subscription.fail(tag, DrainingError())
            return
        timeout = submit.timeout_seconds if submit.timeout_seconds > 0 else None
        try:
            interval = _interval(request)
            params = request_from_pb(request, timeout)
        except (InvalidRequestError, ValueError) as exc:
            connection.subscription.fail(tag, InvalidRequestError(str(exc)))
            return
        trace = context_from_traceparent(submit.traceparent) if submit.traceparent else None
        connection.submit(params, tag, interval, timeout, trace)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStatsResponse:
        workers, refused = pool_stats(self._service.pool)
        return scheduler_pb2.GetStatsResponse(
            workers=[
                to_pb(
                    w,
                    scheduler_pb2.WorkerStats,
                    running=[to_pb(r, scheduler_pb2.RunningSequence) for r in w.running],
                )
                for w in workers
            ],
            refused_workers=[to_pb(r, scheduler_pb2.RefusedWorker) for r in refused],
        )


class DrainingError(Exception):
    """A request submitted on a Connect stream while the scheduler drains."""

    def __init__(self) -> None:
        super().__init__("server is shutting down; retry elsewhere")


def _interval(request: scheduler_pb2.ScheduleRequest) -> int:
    """The request's stream interval (0: every step), checked."""
    interval = request.stream_interval
    if not 0 <= interval <= MAX_STREAM_INTERVAL:
        raise InvalidRequestError(
            f"stream_interval={interval}: must be in 0..{MAX_STREAM_INTERVAL}"
        )
    return max(interval, 1)


def _error_to_pb(exc: Exception) -> scheduler_pb2.RequestError:
    """A Connect request's failure as the status its own Generate call would have had."""
    if isinstance(exc, DrainingError):
        return scheduler_pb2.RequestError(
            code=grpc.StatusCode.UNAVAILABLE.value[0], message=str(exc), retryable=True
        )
    code = STATUS_OF.get(type(exc))
    if code is None:
        if isinstance(exc, SubscriptionError | DuplicateTagError):
            code = grpc.StatusCode.FAILED_PRECONDITION
        elif isinstance(exc, DeadlineError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            code = grpc.StatusCode.INTERNAL
    return scheduler_pb2.RequestError(code=code.value[0], message=str(exc))
