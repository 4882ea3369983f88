"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from canteen.batching import DEFAULT, BatchConfig, field_help
from canteen.config import option, require
from canteen.metrics import METRICS_PORT_HELP
from canteen.tls import InternalLinkOptions
from canteen.tracing import OTLP_ENDPOINT_HELP


@dataclass(frozen=True)
class SchedulerConfig(InternalLinkOptions):
    """Flags and CANTEEN_* variables of ``python -m scheduler``."""

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(50052, "gRPC port")
    metrics_port: int = option(-1, METRICS_PORT_HELP)
    otlp_endpoint: str = option("", OTLP_ENDPOINT_HELP)
    registry: str = option("127.0.0.1:50053", "registry address")
    max_queue: int = option(
        1024, "most requests waiting across workers; more get RESOURCE_EXHAUSTED"
    )
    max_num_seqs: int = option(DEFAULT.max_num_seqs, field_help("max_num_seqs"))
    prefix_cache: bool = option(True, "share the KV of common prompt prefixes across requests")
    max_step_stall: float = option(DEFAULT.max_step_stall, field_help("max_step_stall"))
    pipeline_depth: int = option(DEFAULT.pipeline_depth, field_help("pipeline_depth"))
    grace: float = option(30.0, "seconds in-flight streams get to finish on SIGTERM")
    worker_timeout: float = option(
        30.0, "a worker that does not answer a step within this many seconds is lost (0: never)"
    )
    failover_wait: float = option(
        30.0,
        "seconds a lost worker's sequences wait for another worker of their model "
        "(at most the caller's deadline); then UNAVAILABLE",
    )

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", self.port, "must be in 0..65535")
        self.batch()  # the batch fields' bounds, checked in one place
        require(
            -1 <= self.metrics_port <= 65535,
            "metrics_port",
            self.metrics_port,
            "must be in 0..65535, or -1 for off",
        )
        require(self.max_queue >= 1, "max_queue", self.max_queue, "must be >= 1")
        require(self.grace >= 0, "grace", self.grace, "must be >= 0")
        require(self.worker_timeout >= 0, "worker_timeout", self.worker_timeout, "must be >= 0")
        require(self.failover_wait >= 0, "failover_wait", self.failover_wait, "must be >= 0")

    def batch(self) -> BatchConfig:
        """The batch config every worker's link runs with (each worker's own
        max_batched_tokens replaces the default)."""
        return BatchConfig(
            max_num_seqs=self.max_num_seqs,
            max_step_stall=self.max_step_stall,
            pipeline_depth=self.pipeline_depth,
        )
