"""Gateway configuration."""

from __future__ import annotations

from dataclasses import dataclass

from canteen.config import check_bounds, option, require
from canteen.local_socket import LOCAL_LINK_RULE
from canteen.metrics import METRICS_PORT_HELP
from canteen.plan import MAX_STREAM_INTERVAL
from canteen.tls import InternalLinkOptions
from canteen.tracing import OTLP_ENDPOINT_HELP
from gateway.edge_limits import EdgeLimits


@dataclass(frozen=True)
class GatewayConfig(InternalLinkOptions, EdgeLimits):
    """Flags and CANTEEN_* variables of ``python -m gateway``."""

    host: str = option("", "interface to bind (default 127.0.0.1, or 0.0.0.0 with API keys)")
    port: int = option(50051, "gRPC port of canteen.v1.Inference")
    metrics_port: int = option(-1, METRICS_PORT_HELP)
    otlp_endpoint: str = option("", OTLP_ENDPOINT_HELP)
    http_port: int = option(8080, "port of the OpenAI-compatible HTTP API (-1: off)")
    scheduler: str = option("127.0.0.1:50052", "scheduler address")
    registry: str = option("127.0.0.1:50053", "registry address")
    api_keys_file: str = option("", "file with one API key per line")
    api_keys: str = option("", "comma-separated API keys")
    admin_keys_file: str = option(
        "",
        "admin keys, one a line as 'KEY scope=read': with API keys on, /status and /metrics "
        "need one (give the gateway no scope=write key)",
    )
    admin_keys: str = option("", "comma-separated admin keys (scope write: prefer the file)")
    rate_limit_rpm: int = option(0, "requests per minute per API key (0: unlimited)")
    rate_limit_tpm: int = option(
        0, "tokens per minute per API key, prompt plus max_tokens reserved (0: unlimited)"
    )
    screen: str = option(
        "", "content screen: 'deny-list' (built in) or a 'package.module:factory' entry point"
    )
    screen_config: str = option("", "JSON object passed to the screen's factory")
    reuse_port: bool = option(
        False,
        "share --port and --http-port with sibling gateway processes (SO_REUSEPORT; the "
        "kernel spreads connections); give each its own --metrics-port and --health-port",
    )
    grace: float = option(30.0, "seconds in-flight streams get to finish on SIGTERM")
    scheduler_retry: float = option(
        15.0,
        "seconds a request with no token yet is retried while the scheduler cannot be reached",
    )
    scheduler_stream: str = option(
        "shared",
        "how requests go to the scheduler and tokens come back: 'shared' (one stream for "
        "every request, requests as messages, one message per step), 'subscribe' (one "
        "stream for the tokens, a Generate call per request) or 'per-request' (each "
        "request's own call and stream)",
    )
    local_link: str = option(
        "auto",
        "auto: run the shared stream on the scheduler's private Unix socket where it offers "
        "one this gateway can reach (same host and user); off: over gRPC only",
        LOCAL_LINK_RULE,
    )
    stream_interval: int = option(
        1,
        "tokens per streamed message for requests that do not set stream_interval, "
        "1..64 (1: every token its own message; the first token always goes at once)",
    )
    public_tls_cert: str = option("", "certificate (PEM) of the public gRPC and HTTP ports")
    public_tls_key: str = option("", "private key (PEM) of --public-tls-cert")
    allow_unauthenticated: bool = option(
        False, "serve without API keys on a non-loopback interface (anyone can use it)"
    )
    suite_state: str = option(
        "", "state file of the canteen up that runs this gateway: /status shows its services"
    )
    cache_isolation: str = option(
        "shared",
        "prefix cache between API keys: 'shared' (one cache) or 'key' (each key its own; "
        "no key can learn from cached_tokens or timing what another sent)",
    )

    def __post_init__(self) -> None:
        check_bounds(self)  # the limit table's bounds (gateway/edge_limits.py)
        require(0 <= self.port <= 65535, "port", self.port, "must be in 0..65535")
        require(
            -1 <= self.metrics_port <= 65535,
            "metrics_port",
            self.metrics_port,
            "must be in 0..65535, or -1 for off",
        )
        require(
            -1 <= self.http_port <= 65535, "http_port", self.http_port, "must be in 0..65535 or -1"
        )
        require(self.grace >= 0, "grace", self.grace, "must be >= 0")
        require(self.scheduler_retry >= 0, "scheduler_retry", self.scheduler_retry, "must be >= 0")
        require(self.rate_limit_rpm >= 0, "rate_limit_rpm", self.rate_limit_rpm, "must be >= 0")
        require(self.rate_limit_tpm >= 0, "rate_limit_tpm", self.rate_limit_tpm, "must be >= 0")
        require(
            bool(self.public_tls_cert) == bool(self.public_tls_key),
            "public_tls_cert",
            self.public_tls_cert,
            "--public-tls-cert and --public-tls-key go together",
        )
        require(
            self.scheduler_stream in ("shared", "subscribe", "per-request"),
            "scheduler_stream",
            self.scheduler_stream,
            "must be 'shared', 'subscribe' or 'per-request'",
        )
        require(
            1 <= self.stream_interval <= MAX_STREAM_INTERVAL,
            "stream_interval",
            self.stream_interval,
            f"must be in 1..{MAX_STREAM_INTERVAL}",
        )
        require(
            self.cache_isolation in ("shared", "key"),
            "cache_isolation",
            self.cache_isolation,
            "must be 'shared' or 'key'",
        )
