"""Which KV blocks each sequence holds on one worker: the only code that edits a block table.

A sequence's table lists its blocks in token order; block i holds tokens
``[i*bs, (i+1)*bs)``. Its leading full, computed blocks are also keyed in the prefix cache
(scheduler/blocks.py), so another sequence whose tokens start the same way shares them by
reference instead of computing them again:

    tokens      | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. .. |
    block_ids   |      7      |      2      |      5      |
    block_keys  |     k0      |     k1      |               k1 = H(k0, t4..t7)
    num_computed = 9: blocks 7 and 2 are full and computed, block 5 is partly written

The pool counts one reference per table holding a block. Which sequence gives up its blocks
when the pool runs out (preemption) is the batcher's choice; this class only hands blocks
out, takes them back and keys them.
"""

from __future__ import annotations

from scheduler.blocks import BlockPool
from scheduler.sequence import Sequence


class KVManager:
    def __init__(self, pool: BlockPool, watermark_blocks: int = 0) -> None:
        self.pool = pool
        # Blocks admission and drafts leave free, so running sequences can grow a while.
        self.watermark_blocks = watermark_blocks

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold its first ``num_tokens`` tokens (0 if it has them)."""
        return max(self.pool.blocks_for(num_tokens) - len(seq.block_ids), 0)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` can be taken with the watermark still free after."""
        return self.pool.num_free >= num_blocks + self.watermark_blocks

    # -- handing blocks out ---------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Admission: blocks for ``seq``'s first ``num_tokens`` tokens, leaving the watermark
        free; False, taking nothing, when that does not fit."""
        need = self.num_blocks_needed(seq, num_tokens)
        if not self.can_allocate(need):
            return False
        return self._extend(seq, need)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """A running sequence's next tokens: blocks for its first ``num_tokens``, the
        watermark included; False, taking nothing, when too few are free."""
        return self._extend(seq, self.num_blocks_needed(seq, num_tokens))

    def reserve_drafts(self, seq: Sequence, num_drafts: int, *, num_scheduled: int) -> int:
        """Blocks for up to ``num_drafts`` draft tokens after ``seq``'s ``num_scheduled``
        tokens (computed or in flight, every draft in flight holding), from free blocks
        above the watermark only (drafts never preempt anyone); returns the drafts that
        fit, all of them or the room left in the blocks it holds."""
        end = num_scheduled + 1  # this step's token, after drafts in flight
        need = self.num_blocks_needed(seq, end + num_drafts)
        if num_drafts > 0 and need > 0:
            if not (self.can_allocate(need) and self._extend(seq, need)):
                return min(num_drafts, len(seq.block_ids) * self.block_size - end)
        return max(num_drafts, 0)

    def _extend(self, seq: Sequence, num_blocks: int) -> bool:
        if num_blocks <= 0:
            return True
        blocks = self.pool.allocate(num_blocks)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True

    # -- taking blocks back ---------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """Returns all of ``seq``'s blocks (full computed ones stay cached); it starts over
        from no computed tokens."""
        if seq.block_ids:
            self.pool.free(seq.block_ids)
        self.forget(seq)

    def release_early(self, seq: Sequence, *, num_scheduled: int) -> None:
        """A plan in flight samples ``seq``'s last token: no later plan needs its blocks, so
        the next plan may reuse them (the worker runs the one in flight first). Full blocks
        of known tokens that plans in flight compute (its first ``num_scheduled``) are
        cached now: any plan that reads them runs after the one computing them."""
        self.commit_full_blocks(seq, min(num_scheduled, seq.num_tokens))
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.num_sent_blocks = [], 0

    def forget(self, seq: Sequence) -> None:
        """Empties ``seq``'s table without returning its blocks: for a pool that is gone
        with its worker, and after the blocks went back."""
        seq.block_ids, seq.block_keys, seq.num_computed, seq.num_sent_blocks = [], [], 0, 0

    # -- prefix cache ---------------------------------------------------------------------

    def commit_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Keys every block that became full and computed (of the first ``num_tokens``,
        default the computed ones), so other sequences can share it."""
        bs = self.block_size
        done = seq.num_computed if num_tokens is None else num_tokens
        num_full = min(done // bs, len(seq.block_ids))
        if len(seq.block_keys) >= num_full:
            return
        tokens = seq.tokens
        while len(seq.block_keys) < num_full:
            i = len(seq.block_keys)
            if seq.block_keys:
                parent = seq.block_keys[-1]
            else:
                parent = self.pool.root_for(seq.prefix_salt)
            key = self.pool.commit(seq.block_ids[i], parent, tokens[i * bs : (i + 1) * bs])
            seq.block_keys.append(key)

    def reuse_cached_prefix(self, seq: Sequence) -> None:
        """Starts a sequence that holds no blocks on the longest cached prefix of its
        tokens: those blocks join its table, and their tokens count as computed."""
        if seq.block_ids:
            return
        seq.block_ids, seq.block_keys = self.pool.match_prefix(seq.tokens, seq.prefix_salt)
        seq.num_computed = len(seq.block_ids) * self.block_size
