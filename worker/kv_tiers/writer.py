"""Disk writes off the step's critical path: one background thread, a bounded queue.

A block reaches the writer already copied out of the pool (the host tier's bytes, or the
offload's staging copy), so the pool block can be overwritten at once. Until its file is
renamed into place the block is served from here (``pending``): the scheduler counts it on
disk from the moment it is queued. A full queue makes the step wait (back-pressure: a disk
that cannot keep up slows offloads, it does not lose blocks silently). A write that fails,
or a writer that raises, reports the key dropped: a miss later, never a torn file (the
disk tier writes a temporary file and renames it).

Reads of a plan's disk blocks start together on a small pool of threads, as soon as the
worker receives the plan (``prefetch``), so they overlap the step running before it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from canteen.logging import get_logger
from worker.kv_tiers.disk import DiskTier
from worker.kv_tiers.host import TierBlock

log = get_logger(__name__)

QUEUE_BLOCKS = 256  # staged blocks at most (about 94 MB of SmolLM2 in bfloat16)
READ_THREADS = 4


class DiskWriter:
    def __init__(self, disk: DiskTier, max_queued: int = QUEUE_BLOCKS) -> None:
        self.disk = disk
        self._queue: queue.Queue[tuple[bytes, TierBlock] | None] = queue.Queue(max_queued)
        self._lock = threading.Lock()
        self._pending: dict[bytes, TierBlock] = {}  # queued or being written
        self._dropped: list[bytes] = []  # gone from disk since the last take_dropped
        self._reads: dict[bytes, Future[bytes | OSError]] = {}
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-disk-read")
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def put(self, key: bytes, block: TierBlock) -> None:
        """Queues ``block`` for disk; waits while the queue is full."""
        with self._lock:
            self._pending[key] = block
        self._queue.put((key, block))

    def pending(self, key: bytes) -> TierBlock | None:
        with self._lock:
            return self._pending.get(key)

    def take_dropped(self) -> list[bytes]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def flush(self) -> None:
        """Returns once every block queued so far is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._readers.shutdown(wait=True)

    # -- reads ------------------------------------------------------------------------------

    def prefetch(self, keys: list[bytes]) -> None:
        """Starts reading the files of ``keys`` (any thread; the step collects them)."""
        with self._lock:
            wanted = [k for k in keys if k not in self._pending and k not in self._reads]
            for key in wanted:
                self._reads[key] = self._readers.submit(self.disk.read, key)

    def get_many(self, keys: list[bytes]) -> list[TierBlock | None]:
        """The blocks of ``keys`` from the queue or the disk, their reads issued together
        (those prefetched already started); checked like ``DiskTier.get``."""
        self.prefetch(keys)
        out: list[TierBlock | None] = []
        for key in keys:
            staged = self.pending(key)
            with self._lock:
                read = self._reads.pop(key, None)
            if staged is not None:
                out.append(staged)
            elif read is not None:
                data = read.result()
                if isinstance(data, OSError):  # read before the step's own offload wrote it
                    data = self.disk.read(key)
                out.append(self.disk.accept(key, data))
            else:
                out.append(self.disk.get(key))
        return out

    def forget_reads(self, keys: list[bytes]) -> None:
        """Drops reads of ``keys`` no step collected (their blocks came from host)."""
        with self._lock:
            for key in keys:
                self._reads.pop(key, None)

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, block = item
            try:
                dropped = self.disk.put(key, block)
            except Exception as exc:  # a bug must not stop later writes
                log.warning("kv disk writer failed: the block is dropped", error=repr(exc))
                dropped = [key]
            finally:
                with self._lock:
                    if self._pending.get(key) is block:
                        del self._pending[key]
                self._queue.task_done()
            if dropped:
                with self._lock:
                    self._dropped.extend(dropped)
        self._queue.task_done()
