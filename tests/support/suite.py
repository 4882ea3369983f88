"""Starts the real services as processes on loopback, on free ports, for tests and benches."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.certs import DEFAULT_HOSTS, cert_path, issue, load_ca
from canteen.tls import Tls, sync_channel

ROOT = Path(__file__).resolve().parents[2]
# The registry's admin key in test suites (registry writes need one); CLI calls pass it.
ADMIN_KEY = "test-admin-key"
_ROLES = {
    "registry": "registry",
    "scheduler": "scheduler",
    "worker": "worker",
    "gateway": "gateway",
}

# The dtype of transformers' reference forward (tests/support/reference.py): tests that compare
# a worker's tokens with it pin the worker to it; every other test runs the defaults.
TRANSFORMERS_DTYPE = ("--dtype", "float32")


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A port free on 127.0.0.1 now and not handed out lately: the kernel may give the same
    ephemeral port to two binds in a row once the first closed, and a service then found its
    metrics port taken by its own gRPC port (CI: "address already in use")."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port
    raise RuntimeError("no free port on 127.0.0.1 that was not handed out lately")


@dataclass
class Service:
    name: str
    port: int
    service: str
    process: subprocess.Popen[bytes]
    log_path: Path
    http_port: int = 0
    metrics_port: int = 0
    module: str = ""
    args: list[str] = field(default_factory=list)

    @property
    def metrics_url(self) -> str:
        """Prometheus exposition of this service (``--metrics-port``)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def canteen_models(registry: Service, *args: str) -> subprocess.CompletedProcess[str]:
    """``canteen models ARGS`` against a test registry (plaintext, the test admin key)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "canteen.cli",
            "models",
            "--registry",
            registry.address,
            "--insecure",
            "--admin-key",
            ADMIN_KEY,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def wait_serving(
    address: str,
    service: str,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    tls: Tls | None = None,
    role: str = "",
) -> None:
    deadline = time.monotonic() + timeout
    with sync_channel(address, tls, role) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{service} at {address} exited with {process.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{service} at {address} not SERVING after {timeout}s")


@dataclass
class Suite:
    """registry + scheduler + workers + gateway; ``start_*`` adds one process each."""

    workdir: Path
    services: list[Service] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Mutual TLS with the certificates in this folder (canteen certs); None: --insecure.
    certs: Path | None = None
    # The registry's --model-root (default: two levels above workdir, pytest's temp root).
    model_root: Path | None = None

    def tls(self, role: str = "client", worker_id: str = "worker") -> Tls | None:
        """``role``'s TLS material in this suite (a test's client: ``client``; a worker's:
        ``worker_id``'s)."""
        if self.certs is None:
            return None
        return Tls.from_folder(self.certs, role, worker_id if role == "worker" else "")

    def security_args(self, module: str, name: str = "") -> list[str]:
        """mTLS flags: the role's certificate; a worker's own, issued for its id ``name``."""
        role = _ROLES.get(module)
        if role is None:
            return []
        if self.certs is None:
            return ["--insecure"]
        worker_id = name if role == "worker" else ""
        cert = cert_path(self.certs, role, worker_id)
        if not cert.exists():
            issue(self.certs, role, DEFAULT_HOSTS, load_ca(self.certs), worker_id)
        return [
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(cert.with_suffix(".key")),
            "--tls-ca",
            str(self.certs / "ca.pem"),
        ]

    def channel(self, svc: Service, role: str = "client") -> grpc.Channel:
        """A blocking channel to ``svc`` presenting ``role``'s certificate (or plaintext)."""
        tls = None if svc.module == "gateway" else self.tls(role)
        return sync_channel(svc.address, tls, _ROLES.get(svc.module, svc.module))

    def spawn(
        self,
        name: str,
        module: str,
        args: list[str],
        service: str,
        ready_timeout: float = 300.0,
        wait_ready: bool = True,
        port: int = 0,
    ) -> Service:
        """Starts ``python -m module``; ``port`` reuses a port (a restart), else a free one."""
        port, metrics_port = port or free_port(), free_port()
        log_path = self.workdir / f"{name}.log"
        if log_path.exists():  # a restart keeps the earlier run's log
            log_path = self.workdir / f"{name}.{len(self.services)}.log"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CANTEEN_LOG_LEVEL": os.environ.get("CANTEEN_TEST_LOG_LEVEL", "INFO"),
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                *self.security_args(module, name),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
        )
        svc = Service(name, port, service, process, log_path, metrics_port=metrics_port)
        svc.module, svc.args = module, list(args)
        self.services.append(svc)
        tls = None if module == "gateway" else self.tls()
        address = svc.address
        if "--health-port" in args:  # plaintext health, whatever the main port speaks
            address, tls = f"127.0.0.1:{args[args.index('--health-port') + 1]}", None
        try:
            wait_serving(
                address,
                service if wait_ready else "",
                ready_timeout,
                process,
                tls,
                _ROLES.get(module, ""),
            )
        except Exception as exc:
            raise RuntimeError(f"{name} did not start:\n{svc.log()[-4000:]}") from exc
        return svc

    def restart(self, svc: Service, wait_ready: bool = True) -> Service:
        """Starts ``svc`` again (after it exited) on the same port with the same flags."""
        return self.spawn(
            svc.name, svc.module, svc.args, svc.service, wait_ready=wait_ready, port=svc.port
        )

    def start_registry(self, *args: str, read_keys: tuple[str, ...] = ()) -> Service:
        """With the test admin key (scope write) and ``read_keys`` (scope read), and model
        roots of the whole temp tree (tests add models they built in their own temp folders)."""
        db = str(self.workdir / "registry.db")
        keys = self.workdir / "admin-keys.txt"
        lines = [ADMIN_KEY, *(f"{key} scope=read" for key in read_keys)]
        keys.write_text("".join(f"{line}\n" for line in lines))
        parents = self.workdir.resolve().parents
        root = self.model_root or (parents[1] if len(parents) > 1 else self.workdir)
        security = ["--admin-keys-file", str(keys), "--model-root", str(root)]
        return self.spawn(
            "registry", "registry", ["--db", db, *security, *args], "canteen.v1.Registry"
        )

    def start_tiny_registry(
        self, model_dir: Path, *args: str, read_keys: tuple[str, ...] = ()
    ) -> Service:
        """A registry serving only the tiny test model, as ``tiny:v1``, the default."""
        return self.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={model_dir}",
            "--default-model",
            "tiny",
            *args,
            read_keys=read_keys,
        )

    def start_scheduler(self, registry: Service, *args: str) -> Service:
        """Waits for liveness only: readiness needs a worker."""
        return self.spawn(
            "scheduler",
            "scheduler",
            ["--registry", registry.address, *args],
            "canteen.v1.Scheduler",
            wait_ready=False,
        )

    def start_worker(
        self, registry: Service, model: str, *args: str, name: str = "worker"
    ) -> Service:
        """Runs the worker's defaults (``--dtype auto``: bfloat16 on AMX/AVX512-BF16 CPUs)
        unless ``args`` say otherwise; tests that compare with transformers' float32 forward
        pass TRANSFORMERS_DTYPE."""
        return self.spawn(
            name,
            "worker",
            ["--registry", registry.address, "--model", model, "--worker-id", name, *args],
            "canteen.v1.Worker",
        )

    def start_gateway(
        self, registry: Service, scheduler: Service, *args: str, name: str = "gateway"
    ) -> Service:
        """Also serves HTTP on a free port: ``service.http_url``."""
        http_port = free_port()
        svc = self.spawn(
            name,
            "gateway",
            [
                "--registry",
                registry.address,
                "--scheduler",
                scheduler.address,
                "--http-port",
                str(http_port),
                *args,
            ],
            "canteen.v1.Inference",
        )
        svc.http_port = http_port
        return svc

    def stop(self) -> dict[str, int]:
        """Terminates every service; each one's exit code by name (a name started twice, as
        by ``restart``, gets its pid too)."""
        codes = {}
        for svc in reversed(self.services):
            name = svc.name if svc.name not in codes else f"{svc.name} (pid {svc.process.pid})"
            codes[name] = svc.terminate()
        return codes


@dataclass
class Stack:
    """One of each service, on the default model (SmolLM2), for benchmarks."""

    registry: Service
    scheduler: Service
    worker: Service
    gateway: Service


@contextmanager
def default_model_stack(
    workdir: Path,
    scheduler_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    certs: Path | None = None,
) -> Iterator[Stack]:
    """The suite on SmolLM2; mutual TLS with ``certs`` (a ``canteen certs`` folder), else
    plaintext internal links."""
    from canteen.models import DEFAULT_MODEL_NAME

    workdir.mkdir(parents=True, exist_ok=True)
    suite = Suite(workdir, certs=certs)
    try:
        registry = suite.start_registry()
        scheduler = suite.start_scheduler(registry, *scheduler_args)
        worker = suite.start_worker(registry, DEFAULT_MODEL_NAME, *worker_args)
        wait_serving(
            scheduler.address, "canteen.v1.Scheduler", 120, tls=suite.tls(), role="scheduler"
        )
        gateway = suite.start_gateway(registry, scheduler, *gateway_args)
        yield Stack(registry, scheduler, worker, gateway)
    finally:
        suite.stop()
