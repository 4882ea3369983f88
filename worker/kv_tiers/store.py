"""The worker's tiers under its KV pool, and the copies between them and the pool.

The scheduler decides every move (docs/kv-tiers.md); this module carries out a step's:

    offloads  pool block -> host tier, before the step's forward overwrites the block;
              host evictions -> disk tier (--kv-disk-dir), or dropped
    reloads   host or disk tier -> a fresh pool block, before the forward reads it

and reports what the scheduler cannot know: keys that went from host to disk, keys that are
gone, and reloads that failed (missing, or refused by a checksum). A failed reload is never
served: the worker's ledger does not learn the block's content, so the sequence that needed
it is refused and the scheduler recomputes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from canteen.plan import StepResult
from worker.engine.guard import BlockLedger
from worker.kv_tiers.copies import block_bytes, blocks_bytes, load_blocks
from worker.kv_tiers.disk import DiskTier
from worker.kv_tiers.host import HostTier, TierBlock
from worker.kv_tiers.writer import DiskWriter


def version_digest(*parts: object) -> bytes:
    """32 bytes naming the model version whose KV a block holds: a block is reused only by
    a worker of the same digest (model, version, weights' sha256, dtype, quantization,
    block size)."""
    text = "\0".join(str(p) for p in parts)
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


@dataclass
class TierReport:
    """What the tiers did since the last step's report."""

    tier_moved_keys: list[bytes] = field(default_factory=list)  # host -> disk
    tier_dropped_keys: list[bytes] = field(default_factory=list)  # gone from every tier
    reload_failed_keys: list[bytes] = field(default_factory=list)

    def onto(self, result: StepResult) -> StepResult:
        return dataclasses.replace(
            result,
            tier_moved_keys=tuple(self.tier_moved_keys),
            tier_dropped_keys=tuple(self.tier_dropped_keys),
            reload_failed_keys=tuple(self.reload_failed_keys),
        )


class KVTiers:
    def __init__(
        self, host_bytes: int = 0, disk: DiskTier | None = None, version: bytes = b""
    ) -> None:
        self.host = HostTier(host_bytes)
        self.disk = disk
        self.writer = DiskWriter(disk) if disk is not None else None
        self.version = version  # version_digest of the blocks it holds
        self.disk_id = (
            f"{socket.gethostname()}:{os.path.realpath(disk.folder)}" if disk is not None else ""
        )
        self._report = TierReport()
        self.num_offloads = 0
        self.num_reloads = 0

    @property
    def is_on(self) -> bool:
        return self.host.capacity_bytes > 0 or self.disk is not None

    def put(self, key: bytes, block: TierBlock) -> None:
        """Keeps an evicted block: host first; what host pushes out goes to disk (written
        in the background, reported moved at once: it is served from the queue meanwhile)."""
        self.num_offloads += 1
        for out_key, out_block in self.host.put(key, block):
            if self.writer is None:
                self._report.tier_dropped_keys.append(out_key)
                continue
            self.writer.put(out_key, out_block)
            self._report.tier_moved_keys.append(out_key)

    def get(self, key: bytes) -> TierBlock | None:
        """A block from host or disk, checked; None (reported failed) when neither has a
        whole, matching one."""
        return self.get_many([key])[0]

    def get_many(self, keys: list[bytes]) -> list[TierBlock | None]:
        """``get`` of each key; the disk reads of those not in host are issued together."""
        blocks = [self.host.get(key) for key in keys]
        if self.writer is not None:
            found = iter(
                self.writer.get_many([k for k, b in zip(keys, blocks, strict=True) if b is None])
            )
            blocks = [b if b is not None else next(found) for b in blocks]
        for key, block in zip(keys, blocks, strict=True):
            if block is None:
                self.fail(key)
            else:
                self.num_reloads += 1
        return blocks

    def prefetch(self, keys: tuple[bytes, ...]) -> None:
        """Starts the disk reads a plan's reloads will need (any thread, as it arrives)."""
        if self.writer is not None and keys:
            self.writer.prefetch([key for key in keys if key not in self.host])

    def forget_reads(self, keys: list[bytes]) -> None:
        """Drops the reads started for ``keys`` that no reload collected."""
        if self.writer is not None:
            self.writer.forget_reads(keys)

    def drop(self, key: bytes) -> None:
        self._report.tier_dropped_keys.append(key)

    def fail(self, key: bytes) -> None:
        self._report.reload_failed_keys.append(key)

    def take_report(self) -> TierReport:
        report, self._report = self._report, TierReport()
        if self.writer is not None:  # written off, or evicted from disk, in the background
            for key in self.writer.take_dropped():
                if key not in self.host and self.writer.pending(key) is None:
                    report.tier_dropped_keys.append(key)
        return report

    def host_keys(self) -> list[bytes]:
        """Keys held in the host tier, least recent first."""
        return self.host.keys()

    def disk_keys(self) -> list[bytes]:
        return self.disk.keys() if self.disk is not None else []

    def close(self) -> None:
        """Finishes the disk writes queued so far."""
        if self.writer is not None:
            self.writer.close()


def open_tiers(host_bytes: int, disk_dir: str, disk_bytes: int, version: bytes) -> KVTiers:
    """The worker's tiers from its flags; the disk tier indexes the blocks of ``version``
    it already holds."""
    disk = DiskTier(Path(disk_dir), disk_bytes, version) if disk_dir else None
    return KVTiers(host_bytes, disk, version)


def move(
    tiers: KVTiers,
    pool: torch.Tensor,
    ledger: BlockLedger,
    offloads: list[tuple[int, bytes]],
    reloads: list[tuple[int, bytes]],
    head_major: bool,
) -> TierReport:
    """Runs a plan's tier moves, offloads first (a reload may reuse an offloaded block);
    ``head_major``: the pool's layout (``block_view``). Offloads are copied out of the pool
    here, before the step's forward may overwrite them; their disk writes run behind."""
    kept = []
    for block, key in offloads:
        content = ledger.key_of(block) if 0 <= block < ledger.num_blocks else None
        if content is None or not tiers.is_on:
            tiers.drop(key)  # never computed here, or nowhere to keep it
        else:
            kept.append((block, key, content))
    if kept:
        payloads = blocks_bytes(pool, [block for block, _, _ in kept], head_major)
        for (_, key, content), payload in zip(kept, payloads, strict=True):
            tiers.put(key, TierBlock(content, payload))
    wanted = []
    for block, key in reloads:
        if not (0 <= block < ledger.num_blocks) or ledger.is_held(block):
            tiers.fail(key)  # a live sequence's block is never overwritten
        else:
            wanted.append((block, key))
    found = tiers.get_many([key for _, key in wanted])
    tiers.forget_reads([key for _, key in reloads])  # started on arrival, then not needed
    size = block_bytes(pool)
    loaded = []
    for (block, key), got in zip(wanted, found, strict=True):
        if got is None:
            continue
        if len(got.payload) != size:
            tiers.fail(key)
            continue
        loaded.append((block, got))
    load_blocks(pool, [b for b, _ in loaded], [g.payload for _, g in loaded], head_major)
    for block, got in loaded:
        ledger.loaded(block, got.content_key)
    return tiers.take_report()
