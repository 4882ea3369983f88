"""canteen.probe against a real grpc.aio server on loopback with grpc_health's HealthServicer."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from canteen import probe

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "canteen.v1.Worker"


class HealthServer:
    def __init__(self, server: grpc.aio.Server, servicer: health.aio.HealthServicer, port: int):
        self.server, self.servicer, self.port = server, servicer, port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set(self, service: str, status: int) -> None:
        await self.servicer.set(service, status)


@pytest.fixture
async def health_server() -> AsyncIterator[HealthServer]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        yield HealthServer(server, servicer, port)
    finally:
        await server.stop(None)


async def run_probe(*args: str) -> tuple[int, str]:
    """Runs ``python -m canteen.probe`` as the container healthcheck would."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canteen.probe",
        *args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on exit: nothing listens there


async def test_liveness_serving_exits_0(health_server: HealthServer) -> None:
    code, out = await run_probe(health_server.address)
    assert (code, out.strip()) == (0, "SERVING")


async def test_readiness_serving_exits_0(health_server: HealthServer) -> None:
    await health_server.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    code, out = await run_probe(health_server.address, "--service", SERVICE, "--timeout", "5")
    assert (code, out.strip()) == (0, "SERVING")


async def test_not_serving_exits_1(health_server: HealthServer) -> None:
    code, out = await run_probe(health_server.address, "--service", SERVICE)
    assert (code, out.strip()) == (1, "NOT_SERVING")


async def test_readiness_follows_status_changes(health_server: HealthServer) -> None:
    await health_server.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert (await run_probe(health_server.address, "--service", SERVICE))[0] == 0
    await health_server.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert (await run_probe(health_server.address, "--service", SERVICE))[0] == 1


async def test_unknown_service_exits_1(health_server: HealthServer) -> None:
    code, out = await run_probe(health_server.address, "--service", "canteen.v1.Nope")
    assert code == 1
    assert "NOT_FOUND" in out


async def test_nothing_listening_exits_2() -> None:
    code, out = await run_probe(f"127.0.0.1:{closed_port()}", "--timeout", "0.5")
    assert code == 2
    assert "UNREACHABLE" in out


async def test_check_in_process(health_server: HealthServer) -> None:
    # The same answers through the function the CLI wraps (off the event loop: it blocks).
    assert await asyncio.to_thread(probe.check, health_server.address) == (0, "SERVING")
    assert await asyncio.to_thread(probe.check, health_server.address, SERVICE) == (
        1,
        "NOT_SERVING",
    )
    code, _ = await asyncio.to_thread(probe.check, f"127.0.0.1:{closed_port()}", "", 0.3)
    assert code == 2


async def test_bad_timeout_is_a_usage_error() -> None:
    code, out = await run_probe("127.0.0.1:1", "--timeout", "0")
    assert code == 2
    assert "--timeout" in out
