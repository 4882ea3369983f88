"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from canteen.batching import BatchConfig, flag
from canteen.config import PORT, PORT_OR_OFF, at_least, check_bounds, option
from canteen.local_socket import LOCAL_LINK_RULE
from canteen.metrics import METRICS_PORT_HELP
from canteen.tls import InternalLinkOptions
from canteen.tracing import OTLP_ENDPOINT_HELP


@dataclass(frozen=True)
class SchedulerConfig(InternalLinkOptions):
    """Flags and CANTEEN_* variables of ``python -m scheduler``."""

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(50052, "gRPC port", PORT)
    metrics_port: int = option(-1, METRICS_PORT_HELP, PORT_OR_OFF)
    otlp_endpoint: str = option("", OTLP_ENDPOINT_HELP)
    registry: str = option("127.0.0.1:50053", "registry address")
    local_link: str = option(
        "auto",
        "auto: also serve Connect on a private Unix socket, which a gateway on this host and "
        "user dials instead of gRPC (less CPU a message); off: Connect over gRPC only",
        LOCAL_LINK_RULE,
    )
    max_queue: int = option(
        1024, "most requests waiting across workers; more get RESOURCE_EXHAUSTED", at_least(1)
    )
    max_num_seqs: int = flag("max_num_seqs")
    prefix_cache: bool = option(True, "share the KV of common prompt prefixes across requests")
    max_step_stall: float = flag("max_step_stall")
    pipeline_depth: int = flag("pipeline_depth")
    grace: float = option(30.0, "seconds in-flight streams get to finish on SIGTERM", at_least(0))
    worker_timeout: float = option(
        30.0,
        "a worker that does not answer a step within this many seconds is lost (0: never)",
        at_least(0),
    )
    failover_wait: float = option(
        30.0,
        "seconds a lost worker's sequences wait for another worker of their model "
        "(at most the caller's deadline); then UNAVAILABLE",
        at_least(0),
    )

    def __post_init__(self) -> None:
        check_bounds(self)

    def batch(self) -> BatchConfig:
        """The batch config every worker's link runs with (each worker's own
        max_batched_tokens replaces the default)."""
        return BatchConfig(
            max_num_seqs=self.max_num_seqs,
            max_step_stall=self.max_step_stall,
            pipeline_depth=self.pipeline_depth,
        )
