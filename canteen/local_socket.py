"""A gRPC stream's messages on a private Unix socket, for a peer on the same host and user.

Two internal streams run here as well as on gRPC: the worker's ``Run`` (the scheduler
dials ``WorkerInfo.run_socket``) and the scheduler's ``Connect`` (a gateway dials the
``local_socket`` of the stream's first batch). A grpc.aio message that arrives alone
costs a Python process a few hundred microseconds of CPU, handed from C-core's threads to
a poller thread and then to the event loop; a frame (canteen/frames.py) is one socket read
or write on the loop's own thread. Where the socket cannot be reached (another host,
container or user) the stream stays on gRPC.

Who may connect: the socket lives in a folder of its own with mode 0700, the socket itself
0600, and each end checks the other's user with SO_PEERCRED (this user or root); the
server's first frame (HELLO) names it, and the client checks the name. Any process of this
user can already read the services' certificate keys on such a host, so under mutual TLS
the socket admits no one the gRPC link would refuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from google.protobuf.message import Message

from canteen.config import Bound, one_of
from canteen.frames import FrameError, Kind, check_peer, read_frame, write_frame
from canteen.logging import get_logger

log = get_logger(__name__)

# Linux's limit on a Unix socket's path (sun_path), less its terminating NUL.
MAX_SOCKET_PATH = 107
# The file in a server's folder that it holds locked while it lives.
LOCK_NAME = "owner.lock"
# Seconds a client waits to connect and for the server's hello.
OPEN_TIMEOUT_S = 2.0


# The --local-link flag of the worker, the scheduler and the gateway.
LOCAL_LINK_RULE: Bound = one_of("auto", "off")


class RefusedError(Exception):
    """What a stream's server raises to end it with a reason the client reads."""


class BrokenError(Exception):
    """A local stream failed: the peer went, refused it (with its reason), or broke the
    framing."""


# The stream a server runs for one connection: the client's payloads in, messages out.
Serve = Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]
# The hello of the scheduler's Connect socket (a worker's is its id).
SCHEDULER_NAME = "scheduler"
Request = TypeVar("Request")


class LocalServer:
    """Listens on a fresh private socket; runs ``serve`` for each connection."""

    def __init__(self, prefix: str, name: str, serve: Serve) -> None:
        self._prefix, self._name, self._serve_stream = prefix, name, serve
        self._folder: Path | None = None
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._lock: BinaryIO | None = None
        self.path = ""

    async def start(self) -> str:
        """The socket's path, or "" where it would be too long (TMPDIR too deep)."""
        remove_stale(Path(tempfile.gettempdir()), self._prefix)
        folder = Path(tempfile.mkdtemp(prefix=self._prefix))  # mode 0700
        path = folder / "stream.sock"
        if len(str(path)) > MAX_SOCKET_PATH:
            log.warning("local socket off: path too long", path=str(path))
            folder.rmdir()
            return ""
        self._folder = folder
        # Locked before it takes its name: a server starting beside this one never finds
        # the lock file free and takes the folder for a dead one's.
        self._lock = open(folder / f"{LOCK_NAME}.new", "wb")  # held until the process exits
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(folder / f"{LOCK_NAME}.new", folder / LOCK_NAME)
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))
        os.chmod(path, 0o600)
        self.path = str(path)
        log.info("local socket listening", path=self.path)
        return self.path

    def stop_listening(self) -> None:
        """No new stream (a drain); the open ones run on."""
        if self._server is not None:
            self._server.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def close(self) -> None:
        """Stops listening and ends the open streams (the process is exiting)."""
        self.stop_listening()
        for writer in self._open:
            writer.close()
        if self._lock is not None:  # the folder is gone: nothing left to guard
            self._lock.close()
            self._lock = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        error = ""
        try:
            check_peer(writer)
            write_frame(writer, Kind.HELLO, self._name.encode())
            async for payload in self._serve_stream(payloads(reader)):
                write_frame(writer, Kind.MESSAGE, payload)
                await writer.drain()
        except RefusedError as exc:
            error = str(exc)
        except FrameError as exc:
            log.error("local stream refused", error=str(exc))
            error = str(exc)
        except ConnectionError:
            log.warning("local stream: the peer closed")
        finally:
            self._open.discard(writer)
            await _end(reader, writer, error)


def message_server(
    prefix: str,
    name: str,
    parse: Callable[[bytes], Request],
    run: Callable[[AsyncIterator[Request]], AsyncIterator[Message]],
) -> LocalServer:
    """A server, not yet listening, of a gRPC stream's handler: ``run`` gets the client's
    payloads as ``parse`` reads them (a message type's ``FromString``) and its messages go
    out serialized. The worker serves ``Run`` so, the scheduler ``Connect``."""

    async def requests(payloads: AsyncIterator[bytes]) -> AsyncIterator[Request]:
        async for payload in payloads:
            yield parse(payload)

    async def serve(payloads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for message in run(requests(payloads)):
            yield message.SerializeToString()

    return LocalServer(prefix, name, serve)


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Removes the folders killed processes of this user left (``prefix*`` under
    ``parent``): a live server holds an exclusive lock on its folder's ``owner.lock`` for
    as long as its process lives, so a lock that can be taken is a dead owner's. Another
    user's folder, and a folder without a lock file, are not touched. Returns them."""
    removed = []
    for folder in parent.glob(f"{prefix}*"):
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            with open(folder / LOCK_NAME, "rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # alive (BlockingIOError), no lock file, or not ours to judge
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.info("stale local sockets removed", folders=[str(f) for f in removed])
    return removed


async def payloads(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The peer's MESSAGE payloads until it ends its side or goes."""
    while (frame := await read_frame(reader)) is not None:
        kind, payload = frame
        if kind is not Kind.MESSAGE:
            raise FrameError(f"a {kind.name} frame where a message was expected")
        yield payload


async def _end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: str) -> None:
    """Closes a stream, first telling the client why where it ends on an error. What it
    sent meanwhile is read and dropped until it closes its side (for a second), so the
    close does not reset the connection and lose the ERROR frame on its way."""
    with contextlib.suppress(ConnectionError, FrameError, TimeoutError):
        if error:
            write_frame(writer, Kind.ERROR, error.encode())
            writer.write_eof()
            await writer.drain()
            async with asyncio.timeout(1.0):
                while await read_frame(reader) is not None:
                    pass
        await writer.drain()
    writer.close()


class LocalStream:
    """The client's end: ``write`` payloads, ``read`` payloads (None at the server's end),
    ``done_writing``, ``cancel``; BrokenError on any failure, with the server's reason
    where it gave one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, path: str, name: str) -> LocalStream:
        """Connects and checks the server's hello; OSError, TimeoutError or FrameError
        where this socket is not ``name``'s (the caller stays on gRPC)."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), OPEN_TIMEOUT_S)
        try:
            check_peer(writer)
            frame = await asyncio.wait_for(read_frame(reader), OPEN_TIMEOUT_S)
            if frame is not None and frame[0] is Kind.ERROR:
                raise FrameError(frame[1].decode(errors="replace"))
            if frame is None or frame[0] is not Kind.HELLO:
                raise FrameError(f"no hello at {path}")
            if frame[1] != name.encode():
                raise FrameError(
                    f"the socket {path} is {frame[1].decode(errors='replace')!r}'s, not {name!r}'s"
                )
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer)

    async def write(self, payload: bytes) -> None:
        try:
            write_frame(self._writer, Kind.MESSAGE, payload)
            await self._writer.drain()
        except (ConnectionError, FrameError) as exc:
            raise BrokenError(await self._reason(f"sending: {exc}")) from None

    async def read(self) -> bytes | None:
        try:
            frame = await read_frame(self._reader)
        except (ConnectionError, FrameError) as exc:
            raise BrokenError(f"reading: {exc}") from None
        if frame is None:
            return None
        kind, payload = frame
        if kind is Kind.ERROR:
            raise BrokenError(payload.decode(errors="replace"))
        if kind is not Kind.MESSAGE:
            raise BrokenError(f"a {kind.name} frame where a message was expected")
        return payload

    async def done_writing(self) -> None:
        if self._writer.can_write_eof():
            self._writer.write_eof()

    def cancel(self) -> None:
        self._writer.close()

    async def _reason(self, otherwise: str) -> str:
        """The server's ERROR frame if it sent one before it closed, else ``otherwise``."""
        try:
            while (frame := await asyncio.wait_for(read_frame(self._reader), 1.0)) is not None:
                if frame[0] is Kind.ERROR:
                    return frame[1].decode(errors="replace")
        except (ConnectionError, FrameError, TimeoutError):
            pass
        return otherwise
