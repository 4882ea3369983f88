"""A worker's Run stream over its private socket (canteen/local_socket.py), in the shape of the
grpc.aio call that WorkerLink drives: ``write``, ``read``, ``done_writing``, ``cancel``.

The scheduler dials ``WorkerInfo.run_socket`` when the worker reports one; a socket it
cannot reach (the worker is on another host or in another container), a peer of another
user, or a hello with another worker's id leaves the stream on gRPC. A failure on it
raises canteen/local_socket.py's BrokenError, which the link treats as a gRPC error: the
worker is lost.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from canteen.local_socket import LocalStream
from canteen.v1 import worker_pb2


class RunCall(Protocol):
    """What WorkerLink uses of a Run stream: a grpc.aio call, or a LocalRun."""

    async def write(self, plan: bytes) -> None: ...

    async def read(self) -> object: ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> object: ...


class LocalRun:
    def __init__(self, stream: LocalStream) -> None:
        self._stream = stream

    @classmethod
    async def open(cls, path: str, worker_id: str) -> LocalRun:
        """OSError, TimeoutError or FrameError where the socket is not that worker's."""
        return cls(await LocalStream.open(path, worker_id))

    async def write(self, plan: bytes) -> None:
        """Sends one serialized StepPlan."""
        await self._stream.write(plan)

    async def read(self) -> object:
        """The next StepResult, or ``grpc.aio.EOF`` where the worker closed its side."""
        payload = await self._stream.read()
        if payload is None:
            eof: object = grpc.aio.EOF
            return eof
        return worker_pb2.StepResult.FromString(payload)

    async def done_writing(self) -> None:
        """No more plans: the worker finishes the steps it holds and ends the stream."""
        await self._stream.done_writing()

    def cancel(self) -> None:
        self._stream.cancel()
