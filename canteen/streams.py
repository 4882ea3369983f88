"""Following a server-streaming watch for the life of a process, reconnecting with backoff."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from canteen.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

_FIRST_DELAY, _MAX_DELAY = 0.2, 5.0


async def follow_stream(
    dial: Callable[[], grpc.aio.Channel],
    open_stream: Callable[[grpc.aio.Channel], AsyncIterator[T]],
    on_message: Callable[[T], Awaitable[None]],
    name: str,
    on_broken: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Feeds every message of ``open_stream`` (on a channel from ``dial``) to
    ``on_message``; reopens it when it breaks."""
    delay = _FIRST_DELAY
    while True:
        try:
            async with dial() as channel:
                async for message in open_stream(channel):
                    delay = _FIRST_DELAY
                    await on_message(message)
        except grpc.aio.AioRpcError as exc:
            log.warning("watch broken", stream=name, code=exc.code().name, retry_in=delay)
        if on_broken is not None:
            await on_broken()
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_DELAY)
