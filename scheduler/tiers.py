"""What one worker keeps below its KV pool, as the scheduler tracks it (docs/kv-tiers.md).

The scheduler stays the one owner of block accounting: it decides when a cached block the
pool hands out again is copied down (an offload) and when a tier block is copied back into
a fresh pool block (a reload); the worker executes both and reports what its tiers did on
their own (host -> disk, dropped, failed reloads). Keys are the pool's prefix-cache keys,
whose chain starts from the model version digest and the tenant salt, so a tier hit is
exactly a pool hit that was evicted.

    host   this worker's RAM tier (gone with the worker)
    disk   its --kv-disk-dir; workers of one node on the same folder share one index
"""

from __future__ import annotations

HOST, DISK = "host", "disk"

# One key set per disk folder ("host:/real/path"), shared by the links of every worker that
# reports it: a block one worker wrote is a hit for the others.
_DISKS: dict[str, set[bytes]] = {}


def shared_disk(disk_id: str) -> set[bytes]:
    return _DISKS.setdefault(disk_id, set())


class TierIndex:
    def __init__(
        self,
        disk_id: str = "",
        disk_keys: tuple[bytes, ...] = (),
        host_keys: tuple[bytes, ...] = (),
    ) -> None:
        """``disk_keys``, ``host_keys``: what the worker reported holding when this
        scheduler connected (after a restart of either, its tiers are not empty)."""
        self.host: set[bytes] = set(host_keys)
        self.disk: set[bytes] = shared_disk(disk_id) if disk_id else set()
        self.disk.update(disk_keys)
        self.num_offloads = 0
        self.num_reloads = 0
        self.num_failed_reloads = 0

    def tier_of(self, key: bytes) -> str | None:
        if key in self.host:
            return HOST
        return DISK if key in self.disk else None

    def __contains__(self, key: bytes) -> bool:
        return key in self.host or key in self.disk

    def offloaded(self, key: bytes) -> None:
        """The worker copies ``key`` to its host tier (it moves to disk from there)."""
        self.num_offloads += 1
        self.host.add(key)

    def apply(self, moved: tuple[bytes, ...], dropped: tuple[bytes, ...]) -> None:
        """The worker's report: ``moved`` went host -> disk, ``dropped`` are gone."""
        for key in moved:
            self.host.discard(key)
            self.disk.add(key)
        for key in dropped:
            self.host.discard(key)
            self.disk.discard(key)

    def failed(self, keys: tuple[bytes, ...]) -> None:
        """Reloads that failed: those keys are recomputed from here on."""
        self.num_failed_reloads += len(keys)
        self.apply((), keys)
