"""Length-prefixed frames on an asyncio stream: the wire of the local sockets.

Services on one host and user run the worker's ``Run`` and the scheduler's ``Connect`` on
private Unix sockets as well as on gRPC (canteen/local_socket.py): the same protobuf
messages, each in a frame of its own. A frame is a 5-byte header, its kind (1 byte) and
its payload's length (4 bytes, little-endian), then the payload:

    HELLO    the server's name, UTF-8 (a worker's id, or "scheduler"): its first frame
    MESSAGE  one serialized protobuf message
    ERROR    why the server ends the stream, UTF-8 (a refused second Run stream, say)
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
import struct

from canteen.server import MAX_MESSAGE_BYTES

HEADER = struct.Struct("<BI")
# Bytes a payload may have: the gRPC links' own message limit.
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES


class Kind(enum.IntEnum):
    HELLO = 1
    MESSAGE = 2
    ERROR = 3


class FrameError(Exception):
    """The stream broke the framing: an unknown kind, a payload over the limit, an end
    inside a frame, or a peer that is not of this user."""


def write_frame(writer: asyncio.StreamWriter, kind: Kind, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(
            f"a {kind.name} frame of {len(payload)} bytes is over the limit of "
            f"{MAX_FRAME_BYTES} bytes"
        )
    writer.write(HEADER.pack(kind, len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader) -> tuple[Kind, bytes] | None:
    """The next frame; None where the stream ended cleanly between frames."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"the stream ended {len(exc.partial)} bytes into a header") from None
    code, size = HEADER.unpack(header)
    if code not in Kind.__members__.values():
        raise FrameError(f"frame kind {code} is not one of {[int(k) for k in Kind]}")
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {size} bytes is over the limit of {MAX_FRAME_BYTES} bytes")
    try:
        return Kind(code), await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(
            f"the stream ended {len(exc.partial)} bytes into a {size}-byte frame"
        ) from None


def check_peer(writer: asyncio.StreamWriter) -> None:
    """Raises FrameError unless the socket's peer runs as this process's user (or root):
    the kernel's word (SO_PEERCRED), so no other user's process drives or poses as a
    worker whatever the socket file's mode."""
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    if uid not in (os.getuid(), 0):
        raise FrameError(f"the peer (pid {pid}) runs as uid {uid}, not {os.getuid()}")
