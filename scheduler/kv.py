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

from canteen.plan import StepResult
from scheduler.blocks import BlockPool, chain_key
from scheduler.sequence import Sequence
from scheduler.tiers import TierIndex

Moves = tuple[tuple[int, ...], tuple[bytes, ...], tuple[int, ...], tuple[bytes, ...]]


class KVManager:
    def __init__(
        self, pool: BlockPool, watermark_blocks: int = 0, tiers: TierIndex | None = None
    ) -> None:
        self.pool = pool
        # Blocks admission and drafts leave free, so running sequences can grow a while.
        self.watermark_blocks = watermark_blocks
        # KV tiers under the worker's pool (scheduler/tiers.py); None: evicted blocks are gone
        self.tiers = tiers
        pool.keep_evicted = tiers is not None
        self._offloads: list[tuple[int, bytes]] = []  # evicted, not yet sent
        self._reloads: dict[str, list[tuple[int, bytes]]] = {}  # by seq_id, not yet sent
        self._sent: dict[int, dict[str, list[tuple[int, bytes]]]] = {}  # by step_id

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
            self.pool.free(seq.block_ids)  # reloaded blocks not confirmed yet are not keyed
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
        self._reloads.pop(seq.seq_id, None)

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
        if self.tiers is not None and self.pool.enable_prefix_cache:
            self._reload_from_tiers(seq)
        seq.num_computed = len(seq.block_ids) * self.block_size

    def count_cached_prefix(self, tokens: list[int], salt: str = "") -> int:
        """Leading full blocks of ``tokens`` this worker holds in its pool or its tiers."""
        num = self.pool.count_cached_prefix(tokens, salt)
        if self.tiers is None or not self.pool.enable_prefix_cache:
            return num
        return num + len(self._chain(tokens, salt, num))

    # -- KV tiers (docs/kv-tiers.md) ------------------------------------------------------

    def _chain(self, tokens: list[int], salt: str, start: int) -> list[bytes]:
        """Keys of the full blocks from block ``start`` on held in the pool or the tiers,
        in a row."""
        assert self.tiers is not None
        bs = self.block_size
        parent = self.pool.root_for(salt)
        keys: list[bytes] = []
        for i in range((len(tokens) - 1) // bs):  # one token is always left to compute
            parent = chain_key(parent, tokens[i * bs : (i + 1) * bs])
            if i < start:
                continue
            if not (parent in self.tiers or self.pool.has(parent)):
                break
            keys.append(parent)
        return keys

    def _reload_from_tiers(self, seq: Sequence) -> None:
        """Continues ``seq``'s cached prefix past the pool's hit: blocks in the tiers are
        copied into fresh blocks by the plan that sends it, later ones still cached in the
        pool are shared; it stops at the first block neither holds (or when the pool has no
        room)."""
        assert self.tiers is not None
        keys = self._chain(seq.tokens, seq.prefix_salt, len(seq.block_ids))
        reloads = []
        for key in keys:
            block = self.pool.take(key)
            if block is None:
                self._note_evictions()  # a block just evicted is in the host tier now
                fresh = self.pool.allocate(1) if key in self.tiers else None
                if fresh is None:
                    break
                block = fresh[0]
                reloads.append((block, key))  # keyed in the pool once the worker confirms it
            seq.block_ids.append(block)
            seq.block_keys.append(key)
        self._note_evictions()
        if reloads:
            self._reloads[seq.seq_id] = reloads

    def _note_evictions(self) -> None:
        """Cached blocks the pool handed out again go down to the tiers (the next plan's
        offloads): the index knows them from now on."""
        assert self.tiers is not None
        for block, key in self.pool.evicted:
            self.tiers.offloaded(key)
            self._offloads.append((block, key))
        self.pool.evicted = []

    def take_moves(self, step_id: int, seq_ids: list[str]) -> Moves:
        """The tier moves of the plan ``step_id`` that sends ``seq_ids`` as new: every
        block evicted since the last plan goes down, their reloads come up."""
        if self.tiers is None:
            return (), (), (), ()
        self._note_evictions()
        evicted, self._offloads = self._offloads, []
        reloads = {i: r for i in seq_ids if (r := self._reloads.pop(i, None))}
        if reloads:
            self._sent[step_id] = reloads
        up = [pair for pairs in reloads.values() for pair in pairs]
        self.tiers.num_reloads += len(up)
        return (
            tuple(b for b, _ in evicted),
            tuple(k for _, k in evicted),
            tuple(b for b, _ in up),
            tuple(k for _, k in up),
        )

    def settle(
        self, result: StepResult, current: dict[str, Sequence], refused: set[str]
    ) -> set[str]:
        """Applies a result's tier report; reloaded blocks of the sequences that ran join
        the prefix cache. Returns the refused sequences a failed reload of theirs explains:
        they are recomputed, not failed."""
        sent = self._sent.pop(result.step_id, {})
        if self.tiers is None:
            return set()
        self.tiers.apply(result.tier_moved_keys, result.tier_dropped_keys)
        failed = set(result.reload_failed_keys)
        self.tiers.failed(result.reload_failed_keys)
        retry = set()
        for seq_id, pairs in sent.items():
            seq = current.get(seq_id)
            if seq is None:
                continue
            if seq_id in refused:
                if any(key in failed for _, key in pairs):
                    retry.add(seq_id)
                continue
            held = set(seq.block_ids)  # blocks given back early went plain: not keyed
            for block, key in pairs:
                if block in held:
                    self.pool.adopt(block, key)
        return retry
