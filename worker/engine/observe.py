"""The worker's metrics (step time, KV pool size) and one trace span per sequence it runs."""

from __future__ import annotations

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from canteen.grammar import GRAMMAR_COMPILES
from canteen.metrics import TOKEN_BUCKETS
from canteen.plan import NewSequence, StepPlan, StepResult
from canteen.tracing import context_from_traceparent, get_tracer

tracer = get_tracer("canteen.worker")


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model: str, version: str) -> None:
        labels = ("model", "version")
        self._labels = (model, version)
        registry.register(GRAMMAR_COMPILES)  # the matchers' grammars
        self.step_duration = Histogram(
            "canteen_worker_step_duration_seconds",
            "Seconds of one step on the worker (forward and sampling); kind=prefill when it "
            "computed any prompt tokens, else decode",
            (*labels, "kind"),
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.steps = Counter(
            "canteen_worker_steps", "Steps the worker ran", labels, registry=registry
        )
        self.kv_cache_bytes = Gauge(
            "canteen_worker_kv_cache_bytes", "Bytes of the paged KV pool", labels, registry=registry
        )
        self.memory_budget_bytes = Gauge(
            "canteen_worker_memory_budget_bytes",
            "Memory the worker may use (weights, activations and KV pool)",
            labels,
            registry=registry,
        )
        self.deferred_rows = Counter(
            "canteen_worker_deferred_rows",
            "Rows a step undid because their grammar was still compiling (planned again)",
            labels,
            registry=registry,
        )
        self.sequences = Gauge(
            "canteen_worker_sequences", "Sequences held on the worker", labels, registry=registry
        )

    def set_pool(self, kv_bytes: int, budget_bytes: int) -> None:
        self.kv_cache_bytes.labels(*self._labels).set(kv_bytes)
        self.memory_budget_bytes.labels(*self._labels).set(budget_bytes)

    def observe_step(self, plan: StepPlan, result: StepResult, num_sequences: int) -> None:
        self.sequences.labels(*self._labels).set(num_sequences)
        if not plan.scheduled:
            return
        self.step_duration.labels(*self._labels, plan.kind).observe(result.total_ns / 1e9)
        self.steps.labels(*self._labels).inc()
        if result.deferred_seq_ids:
            self.deferred_rows.labels(*self._labels).inc(len(result.deferred_seq_ids))


class SequenceSpans:
    """A ``worker.sequence`` span from a sequence's arrival to its drop, for traced requests."""

    def __init__(self) -> None:
        self._spans: dict[str, trace.Span] = {}
        self._before_first_token: set[str] = set()

    def on_plan(self, plan: StepPlan) -> None:
        for new in plan.new_sequences:
            if new.traceparent:
                self._start(new)
        for seq_id in plan.dropped_seq_ids:
            self._before_first_token.discard(seq_id)
            span = self._spans.pop(seq_id, None)
            if span is not None:
                span.end()

    def on_result(self, result: StepResult) -> None:
        for token in result.tokens:
            if token.seq_id in self._before_first_token:
                self._before_first_token.discard(token.seq_id)
                self._spans[token.seq_id].add_event("first token sampled")

    def end_all(self) -> None:
        for span in self._spans.values():
            span.end()
        self._spans.clear()
        self._before_first_token.clear()

    def _start(self, new: NewSequence) -> None:
        old = self._spans.pop(new.seq_id, None)
        if old is not None:
            old.end()
        span = tracer.start_span(
            "worker.sequence",
            context=context_from_traceparent(new.traceparent),
            attributes={
                "canteen.num_tokens": len(new.token_ids),
                "canteen.num_cached_tokens": new.num_cached_tokens,
                "canteen.num_blocks": len(new.block_ids),
            },
        )
        self._spans[new.seq_id] = span
        self._before_first_token.add(new.seq_id)
