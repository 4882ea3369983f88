"""The worker's metrics (step time, KV pool size) and one trace span per sequence it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from canteen.grammar import GRAMMAR_COMPILES
from canteen.metrics import TOKEN_BUCKETS
from canteen.plan import NewSequence, StepPlan, StepResult
from canteen.tracing import context_from_traceparent, get_tracer

tracer = get_tracer("canteen.worker")


GAP_BUCKETS = (
    0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Where one step's time went on the worker, from the engine thread's clocks (ns)."""

    arrived: int  # the plan was read off the stream (perf_counter)
    began: int  # the engine thread started the step
    ended: int  # ... and finished it
    cpu_ns: int  # the engine thread's CPU time in the step (the forward's, on one thread)


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
        self.step_cpu = Histogram(
            "canteen_worker_step_cpu_seconds",
            "CPU seconds of the engine thread in one step; below the step's wall time when the "
            "thread was descheduled or waited for torch's other threads",
            (*labels, "kind"),
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.idle = Histogram(
            "canteen_worker_idle_seconds",
            "Seconds the engine sat idle before a decode step that followed another: "
            "cause=plan while its plan had not arrived (waiting on the scheduler), "
            "cause=handoff from the plan's arrival (or the last step's end) to the step",
            (*labels, "cause"),
            buckets=GAP_BUCKETS,
            registry=registry,
        )
        self._last_end = 0
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}  # see _child
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
        self.deferred_rows.labels(*self._labels)  # exported at 0 before the first deferral
        self.sequences = Gauge(
            "canteen_worker_sequences", "Sequences held on the worker", labels, registry=registry
        )

    def set_pool(self, kv_bytes: int, budget_bytes: int) -> None:
        self.kv_cache_bytes.labels(*self._labels).set(kv_bytes)
        self.memory_budget_bytes.labels(*self._labels).set(budget_bytes)

    def observe_step(
        self,
        plan: StepPlan,
        result: StepResult,
        num_sequences: int,
        timing: StepTiming | None = None,
    ) -> None:
        child = self._child
        child(self.sequences).set(num_sequences)
        if not plan.scheduled:
            return
        kind = plan.kind
        child(self.step_duration, kind).observe(result.total_ns / 1e9)
        child(self.steps).inc()
        if result.deferred_seq_ids:
            child(self.deferred_rows).inc(len(result.deferred_seq_ids))
        if timing is None:
            return
        child(self.step_cpu, kind).observe(timing.cpu_ns / 1e9)
        last, self._last_end = self._last_end, timing.ended
        if kind != "decode" or not last or timing.began < last:
            return
        waited = max(timing.arrived - last, 0)  # the engine was free before the plan came
        child(self.idle, "plan").observe(waited / 1e9)
        child(self.idle, "handoff").observe((timing.began - last - waited) / 1e9)

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(model, version, *values)``, looked up once: labels() validates and
        locks on every call, and a step observes seven series."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*self._labels, *values)
        return found


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
