"""The mirror of one worker's KV pool: which block ids are free.

The scheduler is the single owner of block accounting; the worker only writes where a plan
tells it to. Every block is in exactly one place: the free list or one sequence's table.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks}: must be > 0")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` free block ids, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._is_free[block] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._is_free[block]:
                raise ValueError(f"block {block} freed twice")
            self._is_free[block] = True
            self._free.append(block)
