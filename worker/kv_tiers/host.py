"""The host-memory tier: evicted prefix blocks kept in RAM, least recently used out first.

Each block is stored with the worker's own content key (worker/engine/guard.py) and a
checksum of its bytes, checked again when it is read back: memory that changed under it is
never served.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class TierBlock:
    """One block's K/V bytes of every layer, with what proves them."""

    content_key: bytes  # the ledger's chain key of the tokens it holds (unsalted)
    payload: bytes

    @property
    def checksum(self) -> int:
        return zlib.crc32(self.payload)


@dataclass
class _Held:
    block: TierBlock
    checksum: int


class HostTier:
    """key -> block, bounded by ``capacity_bytes``; ``put`` returns what it pushed out."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"kv_host_bytes={capacity_bytes}: must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[bytes, _Held] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def keys(self) -> list[bytes]:
        """Keys held, least recent first (read by GetInfo while steps run: a copy)."""
        return list(self._blocks)

    def put(self, key: bytes, block: TierBlock) -> list[tuple[bytes, TierBlock]]:
        """Keeps ``block`` under ``key``; returns the blocks evicted to make room (the block
        itself when it alone exceeds the capacity)."""
        size = len(block.payload)
        if size > self.capacity_bytes:
            return [(key, block)]
        self.pop(key)
        evicted = []
        while self.num_bytes + size > self.capacity_bytes:
            old_key, held = self._blocks.popitem(last=False)
            self.num_bytes -= len(held.block.payload)
            evicted.append((old_key, held.block))
        self._blocks[key] = _Held(block, block.checksum)
        self.num_bytes += size
        return evicted

    def get(self, key: bytes) -> TierBlock | None:
        """The block under ``key`` when its bytes still match their checksum (it becomes the
        most recent); a block that fails the check is dropped."""
        held = self._blocks.get(key)
        if held is None:
            return None
        if zlib.crc32(held.block.payload) != held.checksum:
            self.pop(key)
            return None
        self._blocks.move_to_end(key)
        return held.block

    def pop(self, key: bytes) -> TierBlock | None:
        held = self._blocks.pop(key, None)
        if held is None:
            return None
        self.num_bytes -= len(held.block.payload)
        return held.block
