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
from worker.kv_tiers.disk import DiskTier
from worker.kv_tiers.host import HostTier, TierBlock


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
        """Keeps an evicted block: host first; what host pushes out goes to disk."""
        self.num_offloads += 1
        for out_key, out_block in self.host.put(key, block):
            if self.disk is None:
                self._report.tier_dropped_keys.append(out_key)
                continue
            dropped = self.disk.put(out_key, out_block)
            self._report.tier_dropped_keys.extend(dropped)
            if out_key not in dropped:
                self._report.tier_moved_keys.append(out_key)

    def get(self, key: bytes) -> TierBlock | None:
        """A block from host or disk, checked; None (reported failed) when neither has a
        whole, matching one."""
        block = self.host.get(key)
        if block is None and self.disk is not None:
            block = self.disk.get(key)
        if block is None:
            self.fail(key)
        else:
            self.num_reloads += 1
        return block

    def drop(self, key: bytes) -> None:
        self._report.tier_dropped_keys.append(key)

    def fail(self, key: bytes) -> None:
        self._report.reload_failed_keys.append(key)

    def take_report(self) -> TierReport:
        report, self._report = self._report, TierReport()
        return report

    def disk_keys(self) -> list[bytes]:
        return self.disk.keys() if self.disk is not None else []


def open_tiers(host_bytes: int, disk_dir: str, disk_bytes: int, version: bytes) -> KVTiers:
    """The worker's tiers from its flags; the disk tier indexes the blocks of ``version``
    it already holds."""
    disk = DiskTier(Path(disk_dir), disk_bytes, version) if disk_dir else None
    return KVTiers(host_bytes, disk, version)


def block_view(pool: torch.Tensor, block: int, head_major: bool) -> torch.Tensor:
    """Every layer's K and V rows of ``block``. The pool is allocated as [layers, 2, blocks,
    block_size, kv_heads, D]; Canteen's own forward reads each layer's share head-major
    instead (worker/attention/paged.py), so there a block's slots are
    [layers, 2, kv_heads, block*bs : (block+1)*bs, D]."""
    layers, _, blocks, size, kv_heads, dim = pool.shape
    if not head_major:
        return pool[:, :, block]
    slots = pool.view(layers, 2, kv_heads, blocks * size, dim)
    return slots[:, :, :, block * size : (block + 1) * size]


def blocks_bytes(pool: torch.Tensor, blocks: list[int], head_major: bool) -> list[bytes]:
    """Each block's ``block_view`` as bytes, gathered in one copy (a block at a time cost
    4 ms of CPU per SmolLM2 block here: 60 small strided copies each)."""
    layers, _, num_blocks, size, kv_heads, dim = pool.shape
    index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    if head_major:
        heads = pool.view(layers, 2, kv_heads, num_blocks, size, dim)
        rows = heads.index_select(3, index).movedim(3, 0)  # [n, layers, 2, heads, bs, D]
    else:
        rows = pool.index_select(2, index).movedim(2, 0)  # [n, layers, 2, bs, heads, D]
    raw = rows.contiguous().cpu().view(torch.uint8).reshape(len(blocks), -1).numpy()
    return [raw[i].tobytes() for i in range(len(blocks))]


def load_block(pool: torch.Tensor, block: int, payload: bytes, head_major: bool) -> bool:
    """Writes ``payload`` into ``block``; False (nothing written) when its size is not one
    block of this pool."""
    target = block_view(pool, block, head_major)
    if len(payload) != target.numel() * target.element_size():
        return False
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    target.copy_(raw.view(pool.dtype).view(target.shape))
    return True


def move(
    tiers: KVTiers,
    pool: torch.Tensor,
    ledger: BlockLedger,
    offloads: list[tuple[int, bytes]],
    reloads: list[tuple[int, bytes]],
    head_major: bool,
) -> TierReport:
    """Runs a plan's tier moves, offloads first (a reload may reuse an offloaded block);
    ``head_major``: the pool's layout (``block_view``)."""
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
    for block, key in reloads:
        if not (0 <= block < ledger.num_blocks) or ledger.is_held(block):
            tiers.fail(key)  # a live sequence's block is never overwritten
            continue
        got = tiers.get(key)
        if got is None:
            continue
        if not load_block(pool, block, got.payload, head_major):
            tiers.fail(key)
            continue
        ledger.loaded(block, got.content_key)
    return tiers.take_report()
