"""The registry's Prometheus metrics, read from the store and directory at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from registry.core import Registry


class RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        table = self._registry.table()
        models = GaugeMetricFamily("canteen_registry_models", "Model versions registered")
        models.add_metric([], len(table.models))
        yield models
        aliases = GaugeMetricFamily("canteen_registry_aliases", "Named aliases registered")
        aliases.add_metric([], len(table.aliases))
        yield aliases
        workers = GaugeMetricFamily(
            "canteen_registry_workers",
            "Workers holding a live lease, by the model version they serve",
            labels=["model", "version"],
        )
        per_version = Counter((w.model, w.version) for w in self._registry.directory.snapshot())
        for (model, version), count in sorted(per_version.items()):
            workers.add_metric([model, version], count)
        yield workers
