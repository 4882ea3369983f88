"""The gateway's Prometheus metrics: what users see, per model version.

Latencies are measured from the request's arrival at the gateway (before tokenization) to the
text leaving it, so they include every hop a user waits for.
"""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from canteen.grammar import GRAMMAR_COMPILES
from canteen.metrics import REQUEST_BUCKETS, TOKEN_BUCKETS
from canteen.tracing import context_from_traceparent, get_tracer

_MODEL = ("model", "version")
_tracer = get_tracer("canteen.gateway")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _MODEL, buckets=buckets, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _MODEL, registry=registry)

        registry.register(GRAMMAR_COMPILES)  # the checks of constraints and tools' parameters

        self.requests = Counter(
            "canteen_requests",
            "Generation requests by final gRPC status (OK, INVALID_ARGUMENT, ...); refusals "
            "before a model was resolved have empty model and version",
            (*_MODEL, "status"),
            registry=registry,
        )
        self.ttft = histogram(
            "canteen_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token",
            REQUEST_BUCKETS,
        )
        self.tpot = histogram(
            "canteen_time_per_output_token_seconds",
            "Mean seconds per output token after the first, one sample per request",
            TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "canteen_inter_token_latency_seconds",
            "Seconds between consecutive streamed token messages",
            TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "canteen_e2e_request_latency_seconds",
            "Seconds from arrival to the last token",
            REQUEST_BUCKETS,
        )
        self.prompt_tokens = counter("canteen_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("canteen_generation_tokens", "Tokens generated")
        self.cached_tokens = counter(
            "canteen_cached_tokens", "Prompt tokens served from the prefix cache"
        )
        # Per LoRA adapter ("name:version"); only registered adapters resolve, so the
        # label stays bounded. Requests with an adapter count under their base model too.
        self.adapter_requests = Counter(
            "canteen_adapter_requests",
            "Generation requests with a LoRA adapter by final gRPC status",
            ("adapter", "status"),
            registry=registry,
        )
        self.adapter_tokens = Counter(
            "canteen_adapter_tokens",
            "Tokens of requests with a LoRA adapter; kind=prompt or generation",
            ("adapter", "kind"),
            registry=registry,
        )
        self.in_flight = Gauge(
            "canteen_gateway_in_flight_requests",
            "Generation requests streaming now",
            registry=registry,
        )
        self._series: dict[tuple[str, str], _Series] = {}

    def refused(self, status: str) -> None:
        """A request refused before it had a model (authentication, shape)."""
        self.requests.labels("", "", status).inc()

    def track(self, model: str, version: str, arrival: float, adapter: str = "") -> RequestTimer:
        """A request's clock, its series by model version (the base of an ``adapter``)."""
        labels = (model, version)
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series(
                *(m.labels(*labels) for m in (self.ttft, self.itl, self.e2e, self.tpot))
            )
        return RequestTimer(self, labels, series, arrival, adapter=adapter)


@dataclass(frozen=True)
class _Series:
    """One model version's latency histograms, looked up once rather than per token."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    tpot: Histogram


# Inter-token gaps a request holds before adding them to the histogram at once.
ITL_FLUSH_GAPS = 64


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, with one increment per bucket hit
    instead of two locked increments per value (prometheus_client's own bucket and sum
    fields: the per-token path cannot afford an observe per message)."""
    bounds = histogram._upper_bounds
    hits = collections.Counter(bisect.bisect_left(bounds, v) for v in values)
    for i, num in hits.items():
        histogram._buckets[i].inc(num)
    histogram._sum.inc(sum(values))


@dataclass
class RequestTimer:
    """One request's clock: call ``tokens`` per streamed message, then ``finish`` once.
    Inter-token gaps reach the histogram ``ITL_FLUSH_GAPS`` at a time, and at the end."""

    metrics: GatewayMetrics
    labels: tuple[str, str]
    series: _Series
    arrival: float
    first: float | None = None
    last: float | None = None
    num_tokens: int = 0
    is_finished: bool = field(default=False)
    adapter: str = ""  # the LoRA adapter's id; "" for the base model
    gaps: list[float] = field(default_factory=list)  # not yet in the ITL histogram

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.series.ttft.observe(now - self.arrival)
        elif self.last is not None:
            self.gaps.append(now - self.last)
            if len(self.gaps) >= ITL_FLUSH_GAPS:
                self._flush_gaps()
        self.last = now
        self.num_tokens += count

    def _flush_gaps(self) -> None:
        if self.gaps:
            observe_all(self.series.itl, self.gaps)
            self.gaps = []

    def finish(self, status: str, prompt_tokens: int, cached_tokens: int) -> None:
        if self.is_finished:
            return
        self.is_finished = True
        self._flush_gaps()
        m, labels = self.metrics, self.labels
        m.requests.labels(*labels, status).inc()
        m.prompt_tokens.labels(*labels).inc(prompt_tokens)
        m.generation_tokens.labels(*labels).inc(self.num_tokens)
        m.cached_tokens.labels(*labels).inc(cached_tokens)
        if self.adapter:
            m.adapter_requests.labels(self.adapter, status).inc()
            m.adapter_tokens.labels(self.adapter, "prompt").inc(prompt_tokens)
            m.adapter_tokens.labels(self.adapter, "generation").inc(self.num_tokens)
        if status != "OK" or self.first is None or self.last is None:
            return
        self.series.e2e.observe(self.last - self.arrival)
        if self.num_tokens > 1:
            self.series.tpot.observe((self.last - self.first) / (self.num_tokens - 1))


def request_span(model_ref: str, num_prompt_tokens: int, traceparent: str, arrival: float) -> Span:
    """The request's ``gateway.generate`` span, started at its arrival (before tokenizing)
    and continuing the caller's W3C trace when it sent one."""
    return _tracer.start_span(
        "gateway.generate",
        context=context_from_traceparent(traceparent),
        start_time=time.time_ns() - int((time.monotonic() - arrival) * 1e9),
        attributes={"canteen.model": model_ref, "canteen.num_prompt_tokens": num_prompt_tokens},
    )
