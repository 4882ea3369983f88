"""The gateway's request path: admit a request, stream its text back, timed and traced.

This file keeps the orchestration only: gateway/validate.py checks shapes, admission.py
prepares and admits (limits, tokenize, templates, grammars, rate limit), output.py turns
streamed token ids into text (stop strings, screen, tool calls, usage), token_endpoints.py
serves tokenize and detokenize.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import Span

from canteen.auth import ANONYMOUS, Principal
from canteen.codec import request_to_pb
from canteen.logging import get_logger
from canteen.request import Request
from canteen.tracing import trace_id_of, trace_metadata
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from gateway.admission import UNSET_MAX_TOKENS_RESERVE, Admission, Admitted
from gateway.catalog import ModelCatalog
from gateway.config import GatewayConfig
from gateway.errors import UpstreamError
from gateway.metrics import GatewayMetrics, request_span
from gateway.output import Output, TextDelta, with_tool_calls
from gateway.screen import Screen
from gateway.token_endpoints import TokenEndpoints
from gateway.tokenizers import TokenizerCache
from gateway.tool_parsers import ToolStream
from gateway.upstream import SchedulerClient
from gateway.validate import GenerateInput, check_shape, choose_request_id

__all__ = [
    "UNSET_MAX_TOKENS_RESERVE",
    "Admitted",
    "GenerateInput",
    "InferenceService",
    "choose_request_id",
    "schedule_request",
]

log = get_logger(__name__)
READY_CACHE_SECONDS = 1.0  # how long /v1/models and ListModels reuse the scheduler's answer


def schedule_request(admitted: Admitted, stream_interval: int = 1) -> scheduler_pb2.ScheduleRequest:
    """What the scheduler is asked to run for an admitted request; ``stream_interval``:
    the gateway's default for a request that sets none."""
    inp, model = admitted.inp, admitted.model
    served = model.served  # an adapter runs on its base model's workers
    request = request_to_pb(
        Request(
            request_id=inp.request_id,
            model=served.name,
            version=served.version,
            prompt_token_ids=tuple(admitted.ids),
            stop_token_ids=tuple(inp.stop_token_ids),
            max_tokens=admitted.max_tokens,
            sampling=inp.sampling,
            ignore_eos=inp.ignore_eos,
            priority=inp.priority,
            cache_salt=admitted.cache_salt,
            disable_speculation=inp.disable_speculation,
            adapter=model.adapter,
        )
    )
    request.stream_interval = inp.stream_interval or stream_interval
    return request


class InferenceService:
    def __init__(
        self,
        config: GatewayConfig,
        catalog: ModelCatalog,
        tokenizers: TokenizerCache,
        scheduler: scheduler_pb2_grpc.SchedulerStub,
        metrics: GatewayMetrics,
        screen: Screen | None = None,
    ) -> None:
        self.metrics = metrics
        self.config = config
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        shared = config.scheduler_stream in ("shared", "subscribe")
        self.upstream = SchedulerClient(
            scheduler,
            config.scheduler_retry,
            shared,
            connect=config.scheduler_stream == "shared",
            local=config.local_link == "auto",
        )
        self.screen = screen
        self.admission = Admission(config, catalog, tokenizers, metrics, screen)
        self.limiter = self.admission.limiter
        self.tokens = TokenEndpoints(self.admission)
        self._ready: tuple[float, set[str]] | None = None  # (when asked, the answer)

    async def ready_models(self) -> set[str]:
        """Names of the models a ready worker serves now (empty when the scheduler is away);
        asked of the scheduler at most once a second, however often models are listed."""
        now = time.monotonic()
        if self._ready is not None and now - self._ready[0] < READY_CACHE_SECONDS:
            return self._ready[1]
        try:
            stats = await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return set()
        ready = {w.model for w in stats.workers if w.is_ready}
        self._ready = (time.monotonic(), ready)
        return ready

    def check_shape(self, inp: GenerateInput) -> None:
        """Checks what needs no tokenizer; raises InvalidInputError naming field and limit."""
        check_shape(inp, self.config)

    async def admit(self, inp: GenerateInput, principal: Principal = ANONYMOUS) -> Admitted:
        """Everything that can refuse a request before any token (admission.py)."""
        return await self.admission.admit(inp, principal)

    async def generate(
        self, inp: GenerateInput, timeout: float | None, principal: Principal = ANONYMOUS
    ) -> AsyncIterator[TextDelta]:
        admitted = await self.admit(inp, principal)
        async for delta in self.stream(admitted, timeout):
            yield delta

    async def stream(self, admitted: Admitted, timeout: float | None) -> AsyncIterator[TextDelta]:
        """Runs an admitted request, timed and traced; its reservation is settled with the
        tokens it used."""
        inp, model = admitted.inp, admitted.model
        served, adapter = model.served, model.adapter
        timer = self.metrics.track(
            served.name, served.version, inp.arrival, "" if adapter is None else adapter.id
        )
        span = request_span(model.ref, len(admitted.ids), inp.traceparent, inp.arrival)
        self.metrics.in_flight.inc()
        status, cached = "CANCELLED", 0
        deltas = self._run(admitted, timeout, span)
        if inp.tools is not None and inp.tools.is_offered:
            fmt, names = admitted.tokenizer.tool_format(inp.tools), inp.tools.names
            split = ToolStream(fmt, names, is_forced=inp.tools.is_forced)
            deltas = with_tool_calls(deltas, split)
        try:
            async for delta in deltas:
                timer.tokens(len(delta.token_ids))
                if delta.finish_reason is not None:
                    status = "OK"
                    cached = delta.usage.cached_tokens if delta.usage is not None else 0
                yield delta
        except UpstreamError as exc:
            status = exc.code.name
            raise
        finally:
            self.metrics.in_flight.dec()
            timer.finish(status, len(admitted.ids), cached)
            span.set_attribute("canteen.num_output_tokens", timer.num_tokens)
            span.set_attribute("canteen.status", status)
            span.end()

    async def _run(
        self, admitted: Admitted, timeout: float | None, span: Span
    ) -> AsyncIterator[TextDelta]:
        inp, model, ids = admitted.inp, admitted.model, admitted.ids
        request = schedule_request(admitted, self.config.stream_interval)
        log.info(
            "request accepted",
            trace_id=trace_id_of(span),
            model=model.ref,
            num_prompt_tokens=len(ids),
            max_tokens=admitted.max_tokens,
        )
        output = Output(admitted.tokenizer, inp.stop, self.screen, model.ref, len(ids))
        metadata = (("x-request-id", inp.request_id), *trace_metadata(span))
        try:
            async for msg in self.upstream.stream(request, timeout, metadata):
                delta = output.push(msg)
                if delta.finish_reason is not None:
                    yield delta
                    return
                if delta.text or delta.token_ids:
                    yield delta
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code(), exc.details() or "scheduler error") from exc
        finally:
            admitted.reservation.settle(len(ids) + output.num_tokens)
