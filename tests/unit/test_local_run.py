"""Which link a worker's Run stream takes (scheduler/link.py ``_open``): the local socket
the worker reports when its hello names it, else gRPC, never a stranger's socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from canteen.frames import Kind, write_frame
from scheduler.link import LinkSettings, WorkerDescription, WorkerLink
from scheduler.local_run import LocalRun


def _link(run_socket: str) -> tuple[WorkerLink, grpc.aio.Channel]:
    desc = WorkerDescription(
        "w1", "127.0.0.1:1", "m", "v1", 8, 16, 256, frozenset(), 64, 128, run_socket=run_socket
    )
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never dialled unless gRPC is chosen
    return WorkerLink(desc, channel, LinkSettings()), channel


async def _hello_server(path: Path, worker_id: str) -> asyncio.Server:
    async def greet(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        write_frame(writer, Kind.HELLO, worker_id.encode())
        await writer.drain()

    return await asyncio.start_unix_server(greet, path=str(path))


async def test_the_workers_own_socket_carries_the_stream(tmp_path: Path) -> None:
    server = await _hello_server(tmp_path / "run.sock", "w1")
    link, channel = _link(str(tmp_path / "run.sock"))
    call = await link._open()
    assert link.transport == "local" and isinstance(call, LocalRun)
    call.cancel()
    server.close()
    await channel.close()


async def test_a_socket_that_is_gone_leaves_the_stream_on_grpc(tmp_path: Path) -> None:
    link, channel = _link(str(tmp_path / "gone.sock"))
    call = await link._open()
    assert link.transport == "grpc" and isinstance(call, grpc.aio.StreamStreamCall)
    call.cancel()
    await channel.close()


async def test_another_workers_socket_leaves_the_stream_on_grpc(tmp_path: Path) -> None:
    server = await _hello_server(tmp_path / "run.sock", "w2")
    link, channel = _link(str(tmp_path / "run.sock"))
    call = await link._open()
    assert link.transport == "grpc" and isinstance(call, grpc.aio.StreamStreamCall)
    call.cancel()
    server.close()
    await channel.close()


async def test_no_socket_reported_means_grpc() -> None:
    link, channel = _link("")
    call = await link._open()
    assert link.transport == "grpc" and isinstance(call, grpc.aio.StreamStreamCall)
    call.cancel()
    await channel.close()
