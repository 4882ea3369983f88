"""The scheduler's Prometheus metrics: queue and step time, finishes, and each worker's batch
and KV pool (read at scrape time from the links, so a departed worker's series vanish)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from canteen.metrics import REQUEST_BUCKETS, TOKEN_BUCKETS
from canteen.plan import StepPlan

if TYPE_CHECKING:
    from scheduler.link import WorkerDescription, WorkerLink

_WORKER_LABELS = ("model", "version", "worker")


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_time = Histogram(
            "canteen_queue_time_seconds",
            "Seconds a request waited before its first step",
            ("model", "version"),
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.step_duration = Histogram(
            "canteen_step_duration_seconds",
            "Wall seconds of one worker step as the scheduler sees it (plan sent to result "
            "read); kind=prefill when the step computed any prompt tokens, else decode",
            ("model", "version", "kind"),
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "canteen_scheduler_requests",
            "Requests the scheduler ended, by how they ended",
            ("model", "version", "finish"),
            registry=registry,
        )
        # Per LoRA adapter ("name:version"); only registered adapters reach the scheduler
        # (the gateway resolves them from the registry), so the label stays bounded.
        self.adapter_requests = Counter(
            "canteen_scheduler_adapter_requests",
            "Requests with a LoRA adapter the scheduler ended, by adapter and how they ended",
            ("adapter", "finish"),
            registry=registry,
        )
        self.adapter_tokens = Counter(
            "canteen_scheduler_adapter_tokens",
            "Tokens of ended requests with a LoRA adapter, by adapter; kind=prompt or generation",
            ("adapter", "kind"),
            registry=registry,
        )

    def observe_step(self, desc: WorkerDescription, plan: StepPlan, seconds: float) -> None:
        if not plan.scheduled:
            return  # a drop-only message computes nothing
        self.step_duration.labels(desc.model, desc.version, plan.kind).observe(seconds)

    def observe_queue(self, model: str, version: str, seconds: float) -> None:
        self.queue_time.labels(model, version).observe(seconds)

    def count_finish(self, model: str, version: str, finish: str) -> None:
        self.requests.labels(model, version, finish).inc()

    def count_adapter(
        self, adapter_id: str, finish: str, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:
        self.adapter_requests.labels(adapter_id, finish).inc()
        self.adapter_tokens.labels(adapter_id, "prompt").inc(num_prompt_tokens)
        self.adapter_tokens.labels(adapter_id, "generation").inc(num_output_tokens)


class PoolCollector(Collector):
    """Per-worker gauges, read from the live links on each scrape (on the event loop)."""

    def __init__(self, links: dict[str, WorkerLink]) -> None:
        self._links = links

    def collect(self) -> Iterator[Metric]:
        g = _gauges()
        preemptions = CounterMetricFamily(
            "canteen_preemptions", "Sequences preempted by recompute", labels=_WORKER_LABELS
        )
        drafts = CounterMetricFamily(
            "canteen_speculative_draft_tokens",
            "Draft tokens proposed and verified (speculative decoding)",
            labels=_WORKER_LABELS,
        )
        accepted = CounterMetricFamily(
            "canteen_speculative_accepted_tokens",
            "Draft tokens accepted: tokens made without a step of their own",
            labels=_WORKER_LABELS,
        )
        for link in list(self._links.values()):
            core, d = link.core, link.desc
            labels = [d.model, d.version, d.worker_id]
            pool = core.pool
            g["running"].add_metric(labels, len(core.running))
            g["waiting"].add_metric(labels, len(core.waiting))
            g["batch"].add_metric(labels, link.last_batch_size)
            g["capacity"].add_metric(labels, pool.num_blocks)
            g["blocks"].add_metric([*labels, "used"], pool.num_used)
            g["blocks"].add_metric([*labels, "cached"], pool.num_cached)
            g["blocks"].add_metric([*labels, "free"], pool.num_free - pool.num_cached)
            g["hit_rate"].add_metric(labels, core.prefix_cache_hit_rate)
            g["ready"].add_metric(labels, 1.0 if link.is_ready else 0.0)
            preemptions.add_metric(labels, core.num_preemptions)
            drafts.add_metric(labels, core.speculation.num_draft_tokens)
            accepted.add_metric(labels, core.speculation.num_accepted_tokens)
            g["acceptance"].add_metric(labels, core.speculation.acceptance_rate)
            if (tiers := core.kv.tiers) is not None:
                g["tiers"].add_metric([*labels, "host"], len(tiers.host))
                g["tiers"].add_metric([*labels, "disk"], len(tiers.disk))
                g["tier_bytes"].add_metric([*labels, "host"], d.kv_host_bytes)
                g["tier_bytes"].add_metric([*labels, "disk"], d.kv_disk_bytes)
                g["reloads"].add_metric([*labels, "ok"], tiers.num_reloads)
                g["reloads"].add_metric([*labels, "failed"], tiers.num_failed_reloads)
        yield from g.values()
        yield from (preemptions, drafts, accepted)


def _gauges() -> dict[str, GaugeMetricFamily]:
    def gauge(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*_WORKER_LABELS, *extra])

    return {
        "running": gauge("canteen_running_requests", "Sequences in the worker's running batch"),
        "waiting": gauge("canteen_waiting_requests", "Sequences waiting for admission"),
        "batch": gauge("canteen_batch_size", "Sequences in the last step sent to the worker"),
        "capacity": gauge("canteen_kv_blocks_capacity", "KV blocks in the worker's pool"),
        "blocks": gauge(
            "canteen_kv_blocks",
            "KV blocks by state: used (referenced), cached (free, holding a cached prefix), "
            "free (empty); they add up to the pool",
            "state",
        ),
        "hit_rate": gauge(
            "canteen_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache"
        ),
        "ready": gauge("canteen_worker_ready", "1 while the worker accepts work, else 0"),
        "acceptance": gauge(
            "canteen_speculative_acceptance_rate",
            "Share of verified draft tokens accepted (0 before any)",
        ),
        "tiers": gauge("canteen_kv_tier_blocks", "KV blocks known in a tier", "tier"),
        "tier_bytes": gauge("canteen_kv_tier_capacity_bytes", "Bytes a KV tier may hold", "tier"),
        "reloads": gauge(
            "canteen_kv_tier_reloads",
            "Tier blocks planned back into the pool (ok), and those that failed a check",
            "outcome",
        ),
    }
