"""Where each child of ``canteen up`` listens and the command line that starts it.

Every port is the base port plus an offset, so ``--base-port`` moves them all:

    base+0  gateway gRPC          base+3  scheduler metrics      base+10+i  worker-i
    base+1  scheduler             base+4  registry metrics       base+74+i  worker-i metrics
    base+2  registry              base+5  gateway metrics
                                  base+6  gateway HTTP (unless --http-port)

With ``--gateways N`` (N > 1) the children gateway-0 .. gateway-(N-1) share the gateway's
gRPC and HTTP ports (``--reuse-port``); gateway-i answers health checks on base+138+i and
serves metrics on base+5 (i = 0) or base+145+i.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from canteen.certs import cert_path
from canteen.local import admin_key_file, certs_dir, data_dir
from canteen.tools.up.gateways import share_rate_limits

MAX_WORKERS = 64
MAX_GATEWAYS = 8
HTTP_OFFSET = 6
_GATEWAY_HEALTH = 74 + MAX_WORKERS  # gateway-i's health port: base + this + i
_GATEWAY_METRICS = _GATEWAY_HEALTH + MAX_GATEWAYS - 1  # gateway-i's metrics (i >= 1)
_SPAN = _GATEWAY_METRICS + MAX_GATEWAYS  # ports above the base a suite may use
_FIXED_OFFSETS = {"gateway": 0, "scheduler": 1, "registry": 2}
_METRICS_OFFSETS = {"scheduler": 3, "registry": 4, "gateway": 5}
SERVICES = {
    "registry": "canteen.v1.Registry",
    "scheduler": "canteen.v1.Scheduler",
    "worker": "canteen.v1.Worker",
    "gateway": "canteen.v1.Inference",
}


@dataclass(frozen=True)
class SuiteLayout:
    base_port: int = 50051
    num_workers: int = 1
    num_gateways: int = 1  # gateway processes sharing the public ports
    model: str = ""
    add_models: list[str] = field(default_factory=list)
    db: str = ""
    host: str = "127.0.0.1"
    http_port: int | None = None  # None: base + HTTP_OFFSET; -1: no HTTP API
    otlp_endpoint: str = ""  # traces of gateway, scheduler and workers go here when set
    insecure: bool = False  # plaintext internal links; else mTLS with certs made at start
    model_roots: tuple[str, ...] = ()  # folders `canteen models add` may register from
    # Extra flags passed through to each kind of child, after the planned ones (they win).
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    registry_args: list[str] = field(default_factory=list)
    state_file: str = ""  # written by the launcher, read by the gateway's /status

    def __post_init__(self) -> None:
        if not 1 <= self.num_workers <= MAX_WORKERS:
            raise ValueError(f"workers={self.num_workers}: must be in 1..{MAX_WORKERS}")
        if not 1 <= self.num_gateways <= MAX_GATEWAYS:
            raise ValueError(f"gateways={self.num_gateways}: must be in 1..{MAX_GATEWAYS}")
        if not 1024 <= self.base_port <= 65535 - _SPAN:
            raise ValueError(f"base_port={self.base_port}: must be in 1024..{65535 - _SPAN}")
        if self.http_port is not None and not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port={self.http_port}: must be in 0..65535, or -1 for off")

    @property
    def http(self) -> int:
        """The gateway's OpenAI-compatible HTTP port; -1 when off."""
        return self.base_port + HTTP_OFFSET if self.http_port is None else self.http_port

    def port(self, name: str) -> int:
        """The gRPC port of a child (``gateway``, ``scheduler``, ``registry``, ``worker-i``)."""
        if name.startswith("worker-"):
            return self.base_port + 10 + int(name.removeprefix("worker-"))
        return self.base_port + _FIXED_OFFSETS[name.partition("-")[0]]

    def metrics_port(self, name: str) -> int:
        """The Prometheus port of a child (the gateway also serves /metrics on its HTTP port)."""
        if name.startswith("worker-"):
            return self.base_port + 74 + int(name.removeprefix("worker-"))
        if name.startswith("gateway-") and name != "gateway-0":
            return self.base_port + _GATEWAY_METRICS + int(name.removeprefix("gateway-"))
        return self.base_port + _METRICS_OFFSETS[name.partition("-")[0]]

    def health_port(self, name: str) -> int:
        """The plaintext health port of a gateway that shares its public port (-1: none,
        the child answers health checks on its gRPC port)."""
        if not name.startswith("gateway-"):
            return -1
        return self.base_port + _GATEWAY_HEALTH + int(name.removeprefix("gateway-"))

    def names(self) -> list[str]:
        """The children in start order."""
        workers = [f"worker-{i}" for i in range(self.num_workers)]
        return ["registry", "scheduler", *workers, *self.gateway_names()]

    def gateway_names(self) -> list[str]:
        """``gateway`` alone, or gateway-0 .. gateway-(N-1) on the same public ports."""
        if self.num_gateways == 1:
            return ["gateway"]
        return [f"gateway-{i}" for i in range(self.num_gateways)]

    def all_ports(self) -> list[int]:
        """Every port the suite opens (a port gateways share, once)."""
        ports = [p for n in self.names() for p in (self.port(n), self.metrics_port(n))]
        ports += [self.health_port(n) for n in self.gateway_names() if self.health_port(n) >= 0]
        ports += [self.http] if self.http >= 0 else []
        return list(dict.fromkeys(ports))


@dataclass(frozen=True)
class ChildSpec:
    """One child: its name, command line and where it answers health checks."""

    name: str
    argv: tuple[str, ...]
    port: int
    metrics_port: int
    health_port: int = -1  # plaintext health, when the gRPC port is shared (gateway-i)

    @property
    def role(self) -> str:
        """Its certificate's role (canteen/certs.py), and its module."""
        return self.name.partition("-")[0]

    @property
    def is_worker(self) -> bool:
        return self.name.startswith("worker-")

    @property
    def service(self) -> str:
        """The gRPC service whose health is this child's readiness."""
        return SERVICES[self.role]

    @property
    def is_public(self) -> bool:
        """Health answers in plaintext (the gateway's public port), not over mTLS."""
        return self.role == "gateway"


def default_db() -> str:
    return str(data_dir() / "registry.db")


def security_args(layout: SuiteLayout, name: str, role: str) -> list[str]:
    """mTLS flags for a child (its role's certificate; a worker's own, for its name as its
    id), or --insecure; the registry's admin key and model roots."""
    extra: list[str] = []
    if name == "registry":
        extra += ["--admin-keys-file", str(admin_key_file())]
        roots = layout.model_roots or (str(Path.home()),)
        extra += ["--model-root", ",".join(roots)]
    if layout.insecure:
        return [*extra, "--insecure"]
    folder = certs_dir()
    cert = cert_path(folder, role, name if role == "worker" else "")
    return [
        *extra,
        *("--tls-cert", str(cert)),
        *("--tls-key", str(cert.with_suffix(".key"))),
        *("--tls-ca", str(folder / "ca.pem")),
    ]


def _own_args(layout: SuiteLayout, name: str) -> list[str]:
    """The flags that make this child what it is in the suite."""
    registry = f"127.0.0.1:{layout.port('registry')}"
    if name == "registry":
        args = ["--db", layout.db or default_db()]
        if layout.add_models:
            args += ["--add-model", ",".join(layout.add_models)]
        if layout.model:
            args += ["--default-model", layout.model.partition(":")[0]]
        return args + layout.registry_args
    if name == "scheduler":
        return ["--registry", registry, *layout.scheduler_args]
    if name.partition("-")[0] == "gateway":
        args = [
            *("--http-port", str(layout.http), "--host", layout.host),
            *("--scheduler", f"127.0.0.1:{layout.port('scheduler')}", "--registry", registry),
        ]
        if layout.state_file:
            args += ["--suite-state", layout.state_file]
        if layout.num_gateways > 1:
            args += ["--reuse-port", "--health-port", str(layout.health_port(name))]
            return args + share_rate_limits(layout.gateway_args, layout.num_gateways)
        return args + layout.gateway_args
    args = ["--registry", registry, "--worker-id", name]
    if layout.model:
        args += ["--model", layout.model]
    return args + layout.worker_args


def plan_children(layout: SuiteLayout) -> list[ChildSpec]:
    """Every child in start order, each with its full command line."""
    specs = []
    for name in layout.names():
        module = role = name.partition("-")[0]
        argv = [sys.executable, "-m", module, "--port", str(layout.port(name))]
        argv += ["--metrics-port", str(layout.metrics_port(name))]
        argv += security_args(layout, name, role)
        if layout.otlp_endpoint and name != "registry":
            argv += ["--otlp-endpoint", layout.otlp_endpoint]
        # Pass-through flags last: argparse keeps the last value, so they override.
        argv += _own_args(layout, name)
        ports = layout.port(name), layout.metrics_port(name), layout.health_port(name)
        specs.append(ChildSpec(name, tuple(argv), *ports))
    return specs
