"""The live worker directory: leases kept alive by heartbeats, watched by schedulers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from canteen.logging import get_logger
from registry.changes import Changes

log = get_logger(__name__)


@dataclass(frozen=True)
class WorkerEntry:
    worker_id: str
    address: str
    model: str
    version: str


class UnknownLeaseError(Exception):
    pass


class NotLeaseOwnerError(Exception):
    """A worker acted on a lease its certificate does not name."""


def check_owner(worker_id: str, owner: str | None) -> None:
    """``owner``: the worker id in the caller's certificate (None on plaintext links, where
    no caller is known). One certificate is one worker: it holds only its own id's lease."""
    if owner is not None and worker_id != owner:
        raise NotLeaseOwnerError(
            f"worker_id={worker_id!r}: this caller's certificate is for worker {owner!r} "
            f"(spiffe://canteen/worker/{owner}); a worker may register, heartbeat and "
            "deregister only its own id"
        )


class WorkerDirectory:
    """Workers with a live lease; a lease lapses ``ttl_seconds`` after its last heartbeat."""

    def __init__(self, ttl_seconds: float) -> None:
        self.ttl_seconds = ttl_seconds
        self._workers: dict[str, WorkerEntry] = {}
        self._expires: dict[str, float] = {}
        self._changes = Changes()

    def snapshot(self) -> list[WorkerEntry]:
        return sorted(self._workers.values(), key=lambda w: w.worker_id)

    async def register(self, entry: WorkerEntry, owner: str | None = None) -> None:
        check_owner(entry.worker_id, owner)
        self._workers[entry.worker_id] = entry
        self._expires[entry.worker_id] = time.monotonic() + self.ttl_seconds
        log.info(
            "worker registered",
            worker_id=entry.worker_id,
            address=entry.address,
            model=entry.model,
            version=entry.version,
        )
        await self._notify()

    async def heartbeat(self, worker_id: str, owner: str | None = None) -> None:
        check_owner(worker_id, owner)
        if worker_id not in self._workers:
            raise UnknownLeaseError(f"worker {worker_id!r} has no live lease; register again")
        self._expires[worker_id] = time.monotonic() + self.ttl_seconds

    async def deregister(
        self, worker_id: str, reason: str = "deregistered", owner: str | None = None
    ) -> None:
        check_owner(worker_id, owner)
        if self._workers.pop(worker_id, None) is not None:
            self._expires.pop(worker_id, None)
            log.info("worker removed", worker_id=worker_id, reason=reason)
            await self._notify()

    async def expire_forever(self) -> None:
        """Drops lapsed leases; runs for the life of the registry."""
        while True:
            await asyncio.sleep(self.ttl_seconds / 4)
            now = time.monotonic()
            for worker_id in [w for w, t in self._expires.items() if t < now]:
                await self.deregister(worker_id, reason="lease expired")

    async def watch(self) -> AsyncIterator[list[WorkerEntry]]:
        """Yields the directory now and after every change."""
        seen = -1
        while True:
            seen = await self._changes.newer_than(seen)
            yield self.snapshot()

    async def _notify(self) -> None:
        await self._changes.bump()
