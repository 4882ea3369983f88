"""A worker's Run stream over its local link (worker/local_link.py), in the shape of the
grpc.aio call that WorkerLink drives: ``write``, ``read``, ``done_writing``, ``cancel``.

The scheduler dials ``WorkerInfo.run_socket`` when the worker reports one; a socket it
cannot reach (the worker is on another host or in another container), a peer of another
user, or a hello with another worker's id leaves the stream on gRPC.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from canteen.frames import FrameError, Kind, check_peer, read_frame, write_frame
from canteen.v1 import worker_pb2

# Seconds to connect and read the worker's hello before falling back to gRPC.
OPEN_TIMEOUT_S = 2.0


class RunCall(Protocol):
    """What WorkerLink uses of a Run stream: a grpc.aio call, or a LocalRun."""

    async def write(self, plan: bytes) -> None: ...

    async def read(self) -> object: ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> object: ...


class LinkBrokenError(Exception):
    """The local stream failed (the worker went, or broke the framing); the link treats
    it as it treats a gRPC error: the worker is lost."""


class LocalRun:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, path: str, worker_id: str) -> LocalRun:
        """Connects and checks the worker's hello; OSError, TimeoutError or FrameError
        where this socket is not that worker's (the caller stays on gRPC)."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), OPEN_TIMEOUT_S)
        try:
            check_peer(writer)
            frame = await asyncio.wait_for(read_frame(reader), OPEN_TIMEOUT_S)
            if frame is not None and frame[0] is Kind.ERROR:
                raise FrameError(frame[1].decode(errors="replace"))
            if frame is None or frame[0] is not Kind.HELLO:
                raise FrameError(f"no hello from the worker at {path}")
            if frame[1] != worker_id.encode():
                raise FrameError(
                    f"the socket {path} is worker {frame[1].decode(errors='replace')!r}'s, "
                    f"not {worker_id!r}'s"
                )
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    async def write(self, plan: bytes) -> None:
        """Sends one serialized StepPlan."""
        try:
            write_frame(self._writer, Kind.MESSAGE, plan)
            await self._writer.drain()
        except (ConnectionError, FrameError) as exc:
            raise LinkBrokenError(await self._reason(f"sending a plan: {exc}")) from None

    async def _reason(self, otherwise: str) -> str:
        """The worker's ERROR frame if it sent one before it closed (a refused stream),
        else ``otherwise``."""
        try:
            while (frame := await asyncio.wait_for(read_frame(self._reader), 1.0)) is not None:
                if frame[0] is Kind.ERROR:
                    return frame[1].decode(errors="replace")
        except (ConnectionError, FrameError, TimeoutError):
            pass
        return otherwise

    async def read(self) -> object:
        """The next StepResult, or ``grpc.aio.EOF`` where the worker closed its side."""
        try:
            frame = await read_frame(self._reader)
        except (ConnectionError, FrameError) as exc:
            raise LinkBrokenError(f"reading a result: {exc}") from None
        if frame is None:
            eof: object = grpc.aio.EOF
            return eof
        kind, payload = frame
        if kind is Kind.ERROR:
            raise LinkBrokenError(payload.decode(errors="replace"))
        if kind is not Kind.MESSAGE:
            raise LinkBrokenError(f"a {kind.name} frame where a StepResult was expected")
        return worker_pb2.StepResult.FromString(payload)

    async def done_writing(self) -> None:
        """No more plans: the worker finishes the steps it holds and ends the stream."""
        if self._writer.can_write_eof():
            self._writer.write_eof()

    def cancel(self) -> None:
        self._writer.close()
