"""The worker's Run stream on a Unix socket, for a scheduler on the same host and user.

Over gRPC every step costs the worker's event loop a plan read and a result write, each
handed between grpc's C-core threads and the loop: a few hundred microseconds of CPU a
step, on the cores the forward pass runs on. The same stream in canteen/frames.py's
frames costs a socket read and a write on the loop's own thread. The scheduler dials the
socket that ``WorkerInfo.run_socket`` names and falls back to gRPC where it cannot (another
host, another container, another user): see scheduler/local_run.py.

Who may connect: the socket lives in a folder of its own with mode 0700, the socket itself
0600, and every peer's user is checked with SO_PEERCRED (this user or root). Any process
of this user can already read the scheduler's certificate key on such a host, so under
mutual TLS the local link admits no one the gRPC link would refuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from canteen.frames import FrameError, Kind, check_peer, read_frame, write_frame
from canteen.logging import get_logger
from canteen.v1 import worker_pb2
from worker.server import RunRefusedError, WorkerServicer

log = get_logger(__name__)

# Linux's limit on a Unix socket's path (sun_path), less its terminating NUL.
MAX_SOCKET_PATH = 107


class LocalLink:
    """A Unix socket server that feeds each connection's frames to ``run_stream``."""

    def __init__(self, servicer: WorkerServicer) -> None:
        self._servicer = servicer
        self._folder: Path | None = None
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.path = ""

    async def start(self) -> str:
        """Listens in a fresh private folder; returns the socket's path, or "" where the
        path would be too long for a Unix socket (TMPDIR too deep): Run stays on gRPC."""
        folder = Path(tempfile.mkdtemp(prefix="canteen-worker-"))  # mode 0700
        path = folder / "run.sock"
        if len(str(path)) > MAX_SOCKET_PATH:
            log.warning("local link off: socket path too long", path=str(path))
            folder.rmdir()
            return ""
        self._folder = folder
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))
        os.chmod(path, 0o600)
        self.path = str(path)
        log.info("local link listening", path=self.path)
        return self.path

    def stop_listening(self) -> None:
        """No new stream (a drain); the open one runs on."""
        if self._server is not None:
            self._server.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def close(self) -> None:
        """Stops listening and ends the open streams (the process is exiting)."""
        self.stop_listening()
        for writer in self._open:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        error = ""
        try:
            check_peer(writer)
            write_frame(writer, Kind.HELLO, self._servicer.identity.worker_id.encode())
            results = self._servicer.run_stream(_plans(reader), "unix:" + self.path)
            async for result in results:
                write_frame(writer, Kind.MESSAGE, result.SerializeToString())
                await writer.drain()
        except RunRefusedError as exc:
            error = exc.message
        except FrameError as exc:
            log.error("local link refused", error=str(exc))
            error = str(exc)
        except ConnectionError:
            log.warning("local link: the scheduler's end closed")
        finally:
            self._open.discard(writer)
            await _end(reader, writer, error)


async def _end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: str) -> None:
    """Closes a stream, first telling the scheduler why where it ends on an error. The
    plans it sent meanwhile are read and dropped until it closes its side (for a second),
    so the close does not reset the connection and lose the ERROR frame on its way."""
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


async def _plans(reader: asyncio.StreamReader) -> AsyncIterator[worker_pb2.StepPlan]:
    """The scheduler's plans until it ends its side (``done_writing``) or goes."""
    while (frame := await read_frame(reader)) is not None:
        kind, payload = frame
        if kind is not Kind.MESSAGE:
            raise FrameError(f"a {kind.name} frame where a StepPlan was expected")
        yield worker_pb2.StepPlan.FromString(payload)
