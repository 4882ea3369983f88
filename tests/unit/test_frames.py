"""canteen/frames.py, the local link's wire, on a real Unix socket pair: messages arrive
whole and in order, a clean end is told from a broken one, and what breaks the framing is
refused with the limit or the kind it broke."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from canteen.frames import (
    HEADER,
    MAX_FRAME_BYTES,
    FrameError,
    Kind,
    check_peer,
    read_frame,
    write_frame,
)

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _with_pair(body: Callable[[Streams, Streams], Awaitable[object]]) -> object:
    async def main() -> object:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a = await asyncio.open_unix_connection(sock=left)
        b = await asyncio.open_unix_connection(sock=right)
        try:
            return await body(a, b)
        finally:
            a[1].close()
            b[1].close()

    return asyncio.run(main())


def test_frames_arrive_whole_in_order_and_a_clean_end_reads_none() -> None:
    async def body(a: Streams, b: Streams) -> list[object]:
        write_frame(a[1], Kind.HELLO, b"worker-1")
        write_frame(a[1], Kind.MESSAGE, b"")
        write_frame(a[1], Kind.MESSAGE, bytes(range(256)) * 300)
        write_frame(a[1], Kind.ERROR, "refusé".encode())
        a[1].write_eof()
        return [await read_frame(b[0]) for _ in range(5)]

    assert _with_pair(body) == [
        (Kind.HELLO, b"worker-1"),
        (Kind.MESSAGE, b""),
        (Kind.MESSAGE, bytes(range(256)) * 300),
        (Kind.ERROR, "refusé".encode()),
        None,
    ]


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (HEADER.pack(2, 10) + b"abc", "the stream ended 3 bytes into a 10-byte frame"),
        (b"\x02\x05", "the stream ended 2 bytes into a header"),
        (HEADER.pack(9, 0), "frame kind 9 is not one of [1, 2, 3]"),
        (
            HEADER.pack(2, MAX_FRAME_BYTES + 1),
            f"a frame of {MAX_FRAME_BYTES + 1} bytes is over the limit of {MAX_FRAME_BYTES} bytes",
        ),
    ],
)
def test_a_broken_frame_is_refused_with_what_broke(raw: bytes, error: str) -> None:
    async def body(a: Streams, b: Streams) -> str:
        a[1].write(raw)
        a[1].write_eof()
        with pytest.raises(FrameError) as broke:
            await read_frame(b[0])
        return str(broke.value)

    assert _with_pair(body) == error


def test_a_payload_over_the_limit_is_not_sent() -> None:
    async def body(a: Streams, b: Streams) -> str:
        with pytest.raises(FrameError) as refused:
            write_frame(a[1], Kind.MESSAGE, bytes(MAX_FRAME_BYTES + 1))
        a[1].write_eof()
        assert await read_frame(b[0]) is None  # nothing of it reached the peer
        return str(refused.value)

    assert _with_pair(body) == (
        f"a MESSAGE frame of {MAX_FRAME_BYTES + 1} bytes is over the limit of "
        f"{MAX_FRAME_BYTES} bytes"
    )


def test_a_peer_of_this_user_passes_the_check() -> None:
    async def body(a: Streams, b: Streams) -> None:
        check_peer(a[1])
        check_peer(b[1])

    _with_pair(body)  # raises FrameError for a peer of another user
