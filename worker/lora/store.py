"""The adapters a worker holds in memory: loaded on demand, least recently used evicted.

``AdapterStore`` keeps up to --max-cpu-loras adapters read and laid out (worker/lora/
adapter.py); the forward applies up to --max-loras of them per step from its own stacked
copy (worker/lora/slots.py), so evicting one here never disturbs a running step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from canteen.adapters import AdapterRef
from canteen.logging import get_logger
from worker.lora.adapter import BaseShape, LoraWeights, load_adapter

log = get_logger(__name__)

LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class LoraOptions:
    """The worker's LoRA flags."""

    max_loras: int = 4
    """Most distinct adapters one step applies; 0: adapters refused."""
    max_cpu_loras: int = 8
    """Most adapters kept loaded in memory (least recently used evicted)."""
    max_rank: int = 64
    """Largest adapter rank served."""
    verify_checksum: bool = True
    """Check each adapter's sha256 against the registry's before it is used."""


class LoraMetrics:
    """Prometheus series of adapter loads, evictions and load time."""

    def __init__(self, registry: CollectorRegistry, model: str, version: str) -> None:
        labels = ("model", "version")
        self._labels = (model, version)
        self.loads = Counter(
            "canteen_worker_lora_loads",
            "LoRA adapters read from disk (digest checked) into memory",
            labels,
            registry=registry,
        )
        self.evictions = Counter(
            "canteen_worker_lora_evictions",
            "LoRA adapters evicted, least recently used first: tier=memory from the "
            "--max-cpu-loras held in memory, tier=step from the --max-loras a step applies",
            (*labels, "tier"),
            registry=registry,
        )
        self.load_seconds = Histogram(
            "canteen_worker_lora_load_seconds",
            "Seconds to read, check and lay out one LoRA adapter",
            labels,
            buckets=LOAD_BUCKETS,
            registry=registry,
        )

        # every series from the start, at zero: a scrape tells "none yet" from "not served"
        self.loads.labels(*self._labels)
        self.load_seconds.labels(*self._labels)
        for tier in ("memory", "step"):
            self.evictions.labels(*self._labels, tier)

    def loaded(self, seconds: float) -> None:
        self.loads.labels(*self._labels).inc()
        self.load_seconds.labels(*self._labels).observe(seconds)

    def evicted(self, tier: str) -> None:
        self.evictions.labels(*self._labels, tier).inc()


class AdapterStore:
    """Adapters in memory by id, most recently used last."""

    def __init__(
        self, options: LoraOptions, shape: BaseShape, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.options, self.shape, self.dtype, self.device = options, shape, dtype, device
        self._held: OrderedDict[str, tuple[str, LoraWeights]] = OrderedDict()  # id -> (sha, w)
        self.metrics: LoraMetrics | None = None
        self.num_loads = 0
        self.num_evictions = 0
        self.load_seconds = 0.0

    def ids(self) -> tuple[str, ...]:
        """The adapters held, in id order."""
        return tuple(sorted(self._held))

    def get(self, ref: AdapterRef) -> LoraWeights:
        """``ref``'s weights, read from its folder unless held (LoraError says why not)."""
        held = self._held.get(ref.id)
        if held is not None and held[0] == ref.sha256:
            self._held.move_to_end(ref.id)
            return held[1]
        started = time.perf_counter()
        o = self.options
        weights = load_adapter(
            ref, self.shape, self.dtype, self.device, o.max_rank, o.verify_checksum
        )
        seconds = time.perf_counter() - started
        self._held.pop(ref.id, None)
        while len(self._held) >= o.max_cpu_loras:
            evicted, _ = self._held.popitem(last=False)
            self.num_evictions += 1
            if self.metrics is not None:
                self.metrics.evicted("memory")
            log.info("lora adapter evicted", adapter=evicted, tier="memory")
        self._held[ref.id] = (ref.sha256, weights)
        self.num_loads += 1
        self.load_seconds += seconds
        if self.metrics is not None:
            self.metrics.loaded(seconds)
        log.info(
            "lora adapter loaded", adapter=ref.id, rank=weights.rank, seconds=round(seconds, 4)
        )
        return weights
