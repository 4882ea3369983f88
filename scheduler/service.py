"""The scheduler's request path: validate, route, run, and always release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from opentelemetry.context import Context

from canteen.finish import Finish
from canteen.logging import get_logger
from canteen.plan import MAX_PRIORITY, MIN_PRIORITY
from canteen.request import Request
from canteen.tracing import get_tracer, traceparent_of
from scheduler.link import WorkerLink
from scheduler.metrics import SchedulerMetrics
from scheduler.router import WorkerPool, fits
from scheduler.sequence import SeqEvent, Sequence, prefix_salt
from scheduler.subscriptions import EventSink, Subscription, Subscriptions

log = get_logger(__name__)
tracer = get_tracer("canteen.scheduler")


class InvalidRequestError(ValueError):
    pass


class NoWorkerError(Exception):
    pass


class QueueFullError(Exception):
    pass


class AdapterNotServedError(Exception):
    """The request names a LoRA adapter and no worker of its model serves adapters."""


class WorkerFailedError(Exception):
    pass


class SequenceRefusedError(Exception):
    """A worker refused the request's plan entry: an invariant broke; it failed alone."""


class SchedulerService:
    def __init__(
        self, pool: WorkerPool, max_queue: int, metrics: SchedulerMetrics | None = None
    ) -> None:
        self.pool = pool
        self.max_queue = max_queue
        self.metrics = metrics
        self.subscriptions = Subscriptions()

    def _admit(self, params: Request, traceparent: str) -> tuple[WorkerLink, Sequence]:
        """Picks a worker and checks the request against it; raises what the caller sees."""
        _validate_shape(params)
        candidates = self.pool.serving(params.model, params.version)
        wanted = f"{params.model}:{params.version}" if params.version else params.model
        if not candidates:
            raise NoWorkerError(f"no ready worker serves model {wanted!r}")
        adapter = params.adapter
        if adapter is not None:
            candidates = [link for link in candidates if link.desc.max_loras > 0]
            if not candidates:
                raise AdapterNotServedError(
                    f"adapter={adapter.id!r}: no ready worker of model {wanted!r} serves LoRA "
                    "adapters (its workers run with --max-loras 0)"
                )
        total = len(params.prompt_token_ids) + params.max_tokens
        fitting = [link for link in candidates if fits(link, total)]
        if not fitting:
            raise InvalidRequestError(_never_fits(params, max(candidates, key=_capacity)))
        salt = prefix_salt(params.cache_salt, adapter)
        adapter_id = "" if adapter is None else adapter.id
        link = self.pool.pick(fitting, list(params.prompt_token_ids), salt, adapter_id)
        desc = link.desc
        _check_vocab(params, desc.vocab_size)
        if self.pool.num_waiting >= self.max_queue:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_queue} requests); retry later"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos or params.sampling.constraint is not None:
            # a complete constraint ends with EOS, the only token its grammar then allows
            stop_ids |= desc.eos_token_ids
        seq = Sequence(
            request_id=params.request_id,
            prompt_ids=list(params.prompt_token_ids),
            max_tokens=params.max_tokens,
            sampling=params.sampling,
            stop_token_ids=frozenset(stop_ids),
            priority=params.priority,
            max_model_len=desc.max_model_len,
            cache_salt=params.cache_salt,
            adapter=adapter,
            allow_speculation=not params.disable_speculation,
            traceparent=traceparent,
            deadline=params.deadline,
        )
        return link, seq

    async def generate(
        self,
        params: Request,
        trace_context: Context | None = None,
        feed: tuple[Subscription, int, int] | None = None,
    ) -> AsyncGenerator[SeqEvent]:
        """Yields the sequence's events until it finishes; cancels it if the caller leaves.
        With ``feed`` (a subscription, the request's tag on it and its stream interval),
        tokens go to the subscription, and only the end comes here."""
        # A span, not a current-span context: the context must not span the yields.
        span = tracer.start_span("scheduler.generate", context=trace_context)
        try:
            link, seq = self._admit(params, traceparent_of(span))
            queue: asyncio.Queue[SeqEvent] = asyncio.Queue()
            sink: EventSink = queue
            if feed is not None:
                sink = feed[0].attach(feed[1], seq, queue, feed[2])
        except Exception as exc:
            span.set_attribute("canteen.error", str(exc))
            span.end()
            raise
        span.set_attribute("canteen.worker", link.desc.worker_id)
        link.adopt(seq, sink)
        log.info(
            "request queued",
            request_id=params.request_id,
            worker_id=link.desc.worker_id,
            num_prompt_tokens=len(params.prompt_token_ids),
            max_tokens=params.max_tokens,
        )
        try:
            async for event in self._events(queue, seq, link):
                yield event
        finally:
            if feed is not None:
                feed[0].detach(feed[1])
            if not seq.is_finished:
                self.pool.cancel(seq)
                log.info(
                    "request cancelled",
                    request_id=params.request_id,
                    num_output_tokens=len(seq.output_ids),
                )
            self._record_end(link, seq)
            span.set_attribute("canteen.num_output_tokens", len(seq.output_ids))
            span.set_attribute("canteen.num_failovers", seq.num_failovers)
            span.end()

    async def _events(
        self, queue: asyncio.Queue[SeqEvent], seq: Sequence, link: WorkerLink
    ) -> AsyncIterator[SeqEvent]:
        is_first = True
        pending: SeqEvent | None = None
        while True:
            event = pending or await queue.get()
            event, pending = _coalesce(event, queue)
            if event.finish is Finish.FAILED:
                raise refusal_of(event)
            if is_first and self.metrics is not None and event.queue_seconds is not None:
                self.metrics.observe_queue(link.desc.model, link.desc.version, event.queue_seconds)
                is_first = False
            yield event
            if event.finish is not None:
                log.info(
                    "request finished",
                    request_id=seq.request_id,
                    finish=event.finish.value,
                    num_output_tokens=len(seq.output_ids),
                )
                return

    def _record_end(self, link: WorkerLink, seq: Sequence) -> None:
        if self.metrics is not None:
            finish = seq.finish.value if seq.finish is not None else Finish.CANCELLED.value
            self.metrics.count_finish(link.desc.model, link.desc.version, finish)
            if seq.adapter is not None:
                self.metrics.count_adapter(
                    seq.adapter_id, finish, len(seq.prompt_ids), len(seq.output_ids)
                )


def refusal_of(event: SeqEvent) -> Exception:
    """The error a failed sequence's caller gets: its own request's fault, a plan entry the
    worker refused, or the worker lost."""
    if event.is_request_error:
        return InvalidRequestError(event.error)
    if event.is_refused:
        return SequenceRefusedError(event.error)
    return WorkerFailedError(event.error)


def _coalesce(event: SeqEvent, queue: asyncio.Queue[SeqEvent]) -> tuple[SeqEvent, SeqEvent | None]:
    """``event`` and the token events queued behind it as one (a reader that fell behind
    the steps gets one message, not one per step), and a failure met on the way, kept for
    after them."""
    while event.finish is None and not queue.empty():
        more = queue.get_nowait()
        if more.finish is Finish.FAILED:
            return event, more
        event = event.then(more)
    return event, None


def _capacity(link: WorkerLink) -> tuple[int, int]:
    return min(
        link.desc.max_model_len, link.desc.num_blocks * link.desc.block_size
    ), link.desc.num_blocks


def _never_fits(params: Request, link: WorkerLink) -> str:
    """Why the request fits no worker, told with the largest worker's numbers."""
    desc = link.desc
    total = len(params.prompt_token_ids) + params.max_tokens
    if total > desc.max_model_len:
        return (
            f"prompt ({len(params.prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
            f"= {total} exceeds the model's context of {desc.max_model_len} tokens"
        )
    return (
        f"prompt + max_tokens = {total} tokens needs {link.core.pool.blocks_for(total)} KV "
        f"blocks; the largest worker has {desc.num_blocks}"
    )


def _validate_shape(params: Request) -> None:
    if not params.request_id:
        raise InvalidRequestError("request_id is required")
    if not params.model:
        raise InvalidRequestError("model is required")
    if not params.prompt_token_ids:
        raise InvalidRequestError("prompt_token_ids must not be empty")
    if params.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens={params.max_tokens}: must be >= 1")
    if (problem := params.sampling.problem()) is not None:
        raise InvalidRequestError(problem)
    if not MIN_PRIORITY <= params.priority <= MAX_PRIORITY:
        raise InvalidRequestError(
            f"priority={params.priority}: must be in {MIN_PRIORITY}..{MAX_PRIORITY}"
        )
    adapter = params.adapter
    if adapter is not None and not (adapter.version and adapter.path and adapter.sha256):
        raise InvalidRequestError(
            f"adapter={adapter.name!r}: version, path and sha256 are all required"
        )


def _check_vocab(params: Request, vocab_size: int) -> None:
    """Token ids come from the gateway's tokenizer; the scheduler checks them all the same."""
    for name, ids in (
        ("prompt_token_ids", params.prompt_token_ids),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{name}: token id {bad} is outside the model's vocabulary of {vocab_size}"
            )
