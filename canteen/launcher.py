"""``canteen up``: the four services as separate processes, started in order, stopped gently.

Each child is waited on through its gRPC readiness (health Watch); Ctrl-C or SIGTERM stops
the gateway first and the registry last, each with SIGTERM so it drains, then SIGKILL for
whatever outlives its grace.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.certs import make_suite_certs
from canteen.local import admin_key_file, certs_dir, data_dir, ensure_admin_key
from canteen.tls import Tls, aio_channel


@dataclass(frozen=True)
class SuiteLayout:
    base_port: int = 50051
    num_workers: int = 1
    model: str = ""
    add_models: list[str] = field(default_factory=list)
    db: str = ""
    worker_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    http_port: int = 8080  # the gateway's OpenAI-compatible HTTP API; -1: off
    otlp_endpoint: str = ""  # traces of gateway, scheduler and workers go here when set
    insecure: bool = False  # plaintext internal links; else mTLS with certs made at start
    model_roots: tuple[str, ...] = ()  # folders `canteen models add` may register from

    def __post_init__(self) -> None:
        if not 1 <= self.num_workers <= 64:
            raise ValueError(f"workers={self.num_workers}: must be in 1..64")
        if not 1024 <= self.base_port <= 65535 - 140:
            raise ValueError(f"base_port={self.base_port}: must be in 1024..65395")

    @property
    def gateway_port(self) -> int:
        return self.base_port

    @property
    def scheduler_port(self) -> int:
        return self.base_port + 1

    @property
    def registry_port(self) -> int:
        return self.base_port + 2

    def worker_port(self, index: int) -> int:
        return self.base_port + 10 + index

    def metrics_port(self, name: str) -> int:
        """Prometheus port of a child: scheduler +3, registry +4, worker-i +74+i (the
        gateway serves /metrics on its HTTP port)."""
        if name.startswith("worker-"):
            return self.base_port + 74 + int(name.removeprefix("worker-"))
        return self.base_port + {"scheduler": 3, "registry": 4, "gateway": 5}[name]


@dataclass
class Child:
    name: str
    argv: list[str]
    port: int
    service: str
    process: asyncio.subprocess.Process | None = None

    @property
    def role(self) -> str:
        """Its certificate's role (canteen/certs.py)."""
        return "worker" if self.name.startswith("worker-") else self.name


def default_db() -> str:
    return str(data_dir() / "registry.db")


def security_args(layout: SuiteLayout, child: Child) -> list[str]:
    """mTLS flags for a child (its role's certificate), or --insecure; the registry's
    admin key and model roots."""
    extra: list[str] = []
    if child.name == "registry":
        extra += ["--admin-keys-file", str(admin_key_file())]
        roots = layout.model_roots or (str(Path.home()),)
        extra += ["--model-root", ",".join(roots)]
    if layout.insecure:
        return [*extra, "--insecure"]
    folder = certs_dir()
    return [
        *extra,
        "--tls-cert",
        str(folder / f"{child.role}.pem"),
        "--tls-key",
        str(folder / f"{child.role}.key"),
        "--tls-ca",
        str(folder / "ca.pem"),
    ]


def plan_children(layout: SuiteLayout) -> list[Child]:
    py = sys.executable
    registry = f"127.0.0.1:{layout.registry_port}"
    reg_args = [
        py,
        "-m",
        "registry",
        "--port",
        str(layout.registry_port),
        "--db",
        layout.db or default_db(),
    ]
    if layout.add_models:
        reg_args += ["--add-model", ",".join(layout.add_models)]
    if layout.model:
        reg_args += ["--default-model", layout.model.partition(":")[0]]
    children = [
        Child("registry", reg_args, layout.registry_port, "canteen.v1.Registry"),
        Child(
            "scheduler",
            [py, "-m", "scheduler", "--port", str(layout.scheduler_port), "--registry", registry],
            layout.scheduler_port,
            "canteen.v1.Scheduler",
        ),
    ]
    for i in range(layout.num_workers):
        argv = [
            py,
            "-m",
            "worker",
            "--port",
            str(layout.worker_port(i)),
            "--registry",
            registry,
            "--worker-id",
            f"worker-{i}",
        ]
        if layout.model:
            argv += ["--model", layout.model]
        children.append(
            Child(
                f"worker-{i}", argv + layout.worker_args, layout.worker_port(i), "canteen.v1.Worker"
            )
        )
    children.append(
        Child(
            "gateway",
            [
                py,
                "-m",
                "gateway",
                "--port",
                str(layout.gateway_port),
                "--http-port",
                str(layout.http_port),
                "--host",
                layout.host,
                "--scheduler",
                f"127.0.0.1:{layout.scheduler_port}",
                "--registry",
                registry,
            ],
            layout.gateway_port,
            "canteen.v1.Inference",
        )
    )
    for child in children:
        child.argv += ["--metrics-port", str(layout.metrics_port(child.name))]
        child.argv += security_args(layout, child)
        if layout.otlp_endpoint and child.name != "registry":
            child.argv += ["--otlp-endpoint", layout.otlp_endpoint]
    return children


async def wait_ready(port: int, service: str, tls: Tls | None, role: str) -> None:
    """Returns once the server on ``port`` reports ``service`` SERVING."""
    async with aio_channel(f"127.0.0.1:{port}", tls, role) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                async for msg in stub.Watch(
                    health_pb2.HealthCheckRequest(service=service), wait_for_ready=True
                ):
                    if msg.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)  # not listening yet; wait_for_ready retries too


class Launcher:
    def __init__(self, layout: SuiteLayout, stop_grace: float = 40.0) -> None:
        self.layout = layout
        self.children = plan_children(layout)
        self.stop_grace = stop_grace
        self._stop = asyncio.Event()

    def _prepare_security(self) -> Tls | None:
        """A fresh throwaway CA and certificates (mTLS), and the registry's admin key."""
        ensure_admin_key()
        folder = certs_dir()
        if self.layout.insecure:
            shutil.rmtree(folder, ignore_errors=True)  # CLI tools must not try TLS
            return None
        make_suite_certs(folder, ["localhost", "127.0.0.1", self.layout.host])
        return Tls.from_folder(folder, "client")

    async def run(self, ready_timeout: float) -> int:
        tls = self._prepare_security()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for child in self.children:
            # Own session: a terminal's Ctrl-C reaches only the launcher, which stops them in order.
            child.process = await asyncio.create_subprocess_exec(
                *child.argv, env=env, start_new_session=True
            )
        exits = [asyncio.ensure_future(c.process.wait()) for c in self.children if c.process]
        readiness = asyncio.ensure_future(
            asyncio.wait_for(
                asyncio.gather(
                    *(
                        wait_ready(c.port, c.service, None if c.name == "gateway" else tls, c.role)
                        for c in self.children
                    )
                ),
                ready_timeout,
            )
        )
        stop = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait([readiness, stop, *exits], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if readiness in done and readiness.exception() is None:
            self._print_endpoints()
            done, _ = await asyncio.wait([stop, *exits], return_when=asyncio.FIRST_COMPLETED)
        if stop not in done:
            code = 1
            print(
                "canteen: a service stopped or did not become ready; stopping the suite",
                file=sys.stderr,
                flush=True,
            )
        readiness.cancel()
        await self._stop_all()
        return code

    def _print_endpoints(self) -> None:
        lay = self.layout
        lines = [
            "Canteen is ready:",
            f"  gateway   {lay.host}:{lay.gateway_port}  (canteen.v1.Inference)",
            *(
                [f"  http      http://{lay.host}:{lay.http_port}/v1  (OpenAI-compatible)"]
                if lay.http_port >= 0
                else []
            ),
            *(
                [f"  status    http://{lay.host}:{lay.http_port}/status  (live batch, KV map)"]
                if lay.http_port >= 0
                else []
            ),
            f"  scheduler 127.0.0.1:{lay.scheduler_port}",
            f"  registry  127.0.0.1:{lay.registry_port}",
            *(f"  worker-{i}  127.0.0.1:{lay.worker_port(i)}" for i in range(lay.num_workers)),
            "Metrics: http://127.0.0.1:PORT/metrics on "
            + ", ".join(f"{c.name} {lay.metrics_port(c.name)}" for c in self.children),
            f"Try: canteen generate --chat 'Hello!' --address 127.0.0.1:{lay.gateway_port}",
        ]
        print("\n".join(lines), flush=True)

    async def _stop_all(self) -> None:
        order = (
            ["gateway", "scheduler"]
            + [c.name for c in self.children if c.name.startswith("worker")]
            + ["registry"]
        )
        by_name = {c.name: c for c in self.children}
        for name in order:
            process = by_name[name].process
            if process is None or process.returncode is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.stop_grace)
            except TimeoutError:
                process.kill()
                await process.wait()
