"""The gateway's shared Connect stream on the scheduler's local socket (canteen/
local_socket.py), read as ``Feed`` reads a grpc.aio call.

The gateway opens Connect over gRPC as ever; where the first batch names a socket this
gateway can reach (the scheduler's host and user) and says it is the scheduler's, the
stream moves there and the gRPC one closes. Requests go up as the Outbox's messages, one
frame each; a broken socket is the same UNAVAILABLE a broken gRPC stream raises, so the
retry and failover above see no difference.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from canteen.frames import FrameError
from canteen.local_socket import SCHEDULER_NAME, BrokenError, LocalStream
from canteen.logging import get_logger
from canteen.v1 import scheduler_pb2
from gateway.upstream_connect import Outbox

log = get_logger(__name__)


class LocalConnect:
    def __init__(self, stream: LocalStream, outbox: Outbox) -> None:
        self._stream = stream
        self._pump = asyncio.ensure_future(self._send(outbox))

    @classmethod
    async def open(cls, path: str, outbox: Outbox) -> LocalConnect | None:
        """The stream on the socket at ``path``; None where it cannot be had (logged)."""
        try:
            stream = await LocalStream.open(path, SCHEDULER_NAME)
        except (OSError, TimeoutError, FrameError) as exc:
            log.info("scheduler's local socket unreachable", path=path, error=str(exc))
            return None
        return cls(stream, outbox)

    async def _send(self, outbox: Outbox) -> None:
        try:
            async for msg in outbox.messages():
                await self._stream.write(msg.SerializeToString())
            await self._stream.done_writing()
        except BrokenError:
            pass  # the reader raises it

    async def read(self) -> Any:  # a ScheduleBatch, or grpc.aio.EOF
        """The next ScheduleBatch, or ``grpc.aio.EOF`` where the scheduler ended it."""
        try:
            payload = await self._stream.read()
        except BrokenError as exc:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"the scheduler's local stream failed: {exc}",
            ) from None
        if payload is None:
            return grpc.aio.EOF
        return scheduler_pb2.ScheduleBatch.FromString(payload)

    def cancel(self) -> None:
        self._pump.cancel()
        self._stream.cancel()
