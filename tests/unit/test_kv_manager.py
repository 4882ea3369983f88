"""KVManager alone on a real block pool: examples of each verb, and a random mix of
admissions, prefill chunks, drafts, early releases, preemptions and cancels that must never
leak a block, count one wrongly, or share one between sequences whose tokens differ."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from canteen.plan import Sampling
from scheduler.blocks import BlockPool, chain_key
from scheduler.kv import KVManager
from scheduler.sequence import Sequence

BS = 4
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]


def make_seq(prompt: list[int], salt: str = "") -> Sequence:
    return Sequence("r", list(prompt), 1 << 20, Sampling(temperature=0.0), cache_salt=salt)


def make_kv(num_blocks: int = 8, watermark_blocks: int = 0, enable: bool = True) -> KVManager:
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=enable, cache_salt="m:v1")
    return KVManager(pool, watermark_blocks)


def next_token(tokens: list[int]) -> int:
    """The fake model: few distinct tokens, so equal prompts' outputs share blocks too."""
    return (sum(tokens) * 7 + len(tokens)) % 3 + 40


def compute(kv: KVManager, seq: Sequence, num_tokens: int) -> None:
    """What the worker does: computes ``num_tokens`` more of ``seq``'s tokens into its
    blocks, samples the next token once every known one is computed, and the scheduler
    then keys the blocks that became full."""
    assert seq.num_computed + num_tokens <= len(seq.block_ids) * BS, "no slot for a token"
    seq.num_computed += num_tokens
    if seq.num_computed == seq.num_tokens:
        seq.output_ids.append(next_token(seq.tokens))
    kv.commit_full_blocks(seq)


# -- examples -------------------------------------------------------------------------------


def test_release_returns_every_block_and_the_sequence_starts_over() -> None:
    kv, seq = make_kv(), make_seq(list(range(10)))
    assert kv.allocate(seq, 10)
    assert len(seq.block_ids) == 3 and kv.pool.num_free == 5
    compute(kv, seq, 10)
    kv.release(seq)
    assert kv.pool.num_free == 8
    assert (seq.block_ids, seq.block_keys, seq.num_computed) == ([], [], 0)


def test_allocate_leaves_the_watermark_free_and_takes_nothing_when_refused() -> None:
    kv, seq = make_kv(num_blocks=4, watermark_blocks=1), make_seq(list(range(16)))
    assert not kv.allocate(seq, 16)
    assert seq.block_ids == [] and kv.pool.num_free == 4
    assert kv.allocate(seq, 12)
    assert len(seq.block_ids) == 3 and kv.pool.num_free == 1
    assert kv.grow(seq, 16)  # a running sequence may use the watermark
    assert kv.pool.num_free == 0
    assert not kv.grow(seq, 17) and len(seq.block_ids) == 4


def test_drafts_take_only_the_room_left_when_no_block_is_spare() -> None:
    kv, seq = make_kv(num_blocks=2, watermark_blocks=1), make_seq([1, 2])
    assert kv.allocate(seq, 2)
    compute(kv, seq, 2)  # decoding: 3 tokens known, the last not yet computed
    # nothing in flight: its computed tokens are all it has scheduled
    assert kv.reserve_drafts(seq, 5, num_scheduled=seq.num_computed) == 1  # one slot left
    assert len(seq.block_ids) == 1 and kv.pool.num_free == 1
    kv.watermark_blocks = 0
    assert kv.reserve_drafts(seq, 5, num_scheduled=seq.num_computed) == 5
    assert len(seq.block_ids) == 2 and kv.pool.num_free == 0


def test_a_later_sequence_reuses_the_cached_prefix() -> None:
    kv, first = make_kv(), make_seq([*PREFIX, 1])
    assert kv.allocate(first, 9)
    compute(kv, first, 9)
    cached = first.block_ids[:2]
    kv.release(first)
    assert kv.pool.num_cached == 2 and kv.pool.num_free == 8
    second = make_seq([*PREFIX, 5, 6])
    kv.reuse_cached_prefix(second)
    assert second.block_ids == cached and second.num_computed == 8
    assert kv.pool.num_cached == 0 and kv.pool.num_free == 6
    tenant = make_seq([*PREFIX, 5, 6], salt="tenant-b")
    kv.reuse_cached_prefix(tenant)
    assert tenant.block_ids == [] and tenant.num_computed == 0  # another tenant's blocks


def test_running_sequences_share_a_prefix_by_reference() -> None:
    kv, first = make_kv(), make_seq([*PREFIX, 1])
    assert kv.allocate(first, 9)
    compute(kv, first, 9)
    second = make_seq([*PREFIX, 7])
    kv.reuse_cached_prefix(second)
    assert kv.allocate(second, 9)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert [kv.pool.refs(b) for b in second.block_ids] == [2, 2, 1]
    kv.release(first)
    assert [kv.pool.refs(b) for b in second.block_ids] == [1, 1, 1]
    assert kv.pool.num_free == 5


def test_release_early_caches_the_blocks_the_plan_in_flight_fills() -> None:
    kv, seq = make_kv(), make_seq([*PREFIX, 1])
    assert kv.allocate(seq, 9)
    kv.release_early(seq, num_scheduled=9)  # the plan sent computes all nine
    assert seq.block_ids == [] and len(seq.block_keys) == 2
    assert kv.pool.num_free == 8 and kv.pool.num_cached == 2
    again = make_seq([*PREFIX, 1])
    kv.reuse_cached_prefix(again)
    assert again.num_computed == 8


def test_forget_leaves_a_lost_workers_pool_as_it_was() -> None:
    kv, seq = make_kv(), make_seq(list(range(6)))
    assert kv.allocate(seq, 6)
    kv.forget(seq)
    assert seq.block_ids == [] and kv.pool.num_free == 6


# -- random operations --------------------------------------------------------------------

PREFIXES = ([*PREFIX, 19, 20], [11, 12, 13, 14, 30, 31, 32], [50, 51, 52, 53, 54, 55, 56, 57])


class KVModel(RuleBasedStateMachine):
    """One worker's sequences, stepped one plan at a time, with invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = make_kv()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.draining: list[Sequence] = []  # blocks released early, the last plan in flight

    @property
    def live(self) -> list[Sequence]:
        return [*self.waiting, *self.running, *self.draining]

    @initialize(
        num_blocks=st.integers(3, 16),
        watermark=st.integers(0, 2),
        enable=st.sampled_from([True, True, False]),
    )
    def make_pool(self, num_blocks: int, watermark: int, enable: bool) -> None:
        self.kv = make_kv(num_blocks, watermark, enable)

    @rule(
        which=st.integers(0, len(PREFIXES) - 1),
        cut=st.integers(0, 10) | st.just(10),
        tail=st.lists(st.integers(0, 2), max_size=6),
        salt=st.sampled_from(["", "tenant-b"]),
    )
    def add(self, which: int, cut: int, tail: list[int], salt: str) -> None:
        self.waiting.append(make_seq([*PREFIXES[which][:cut], *tail] or [0], salt))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 12))
    def admit(self, pick: int, chunk: int) -> None:
        seq = self.waiting[pick % len(self.waiting)]
        self.kv.reuse_cached_prefix(seq)
        assert seq.num_uncomputed >= 1  # the last prompt token is always computed
        held, num_free = list(seq.block_ids), self.kv.pool.num_free
        n = min(chunk, seq.num_uncomputed)
        if not self.kv.allocate(seq, seq.num_computed + n):
            assert (seq.block_ids, self.kv.pool.num_free) == (held, num_free)
            self.kv.release(seq)
            return
        assert self.kv.pool.num_free >= self.kv.watermark_blocks
        self.waiting.remove(seq)
        self.running.append(seq)
        compute(self.kv, seq, n)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 12))
    def step(self, pick: int, chunk: int) -> None:
        """A prefill chunk or a decode; others are preempted, newest first, to make room."""
        seq = self.running[pick % len(self.running)]
        n = min(chunk, seq.num_uncomputed)
        if self._make_room(seq, seq.num_computed + n):
            compute(self.kv, seq, n)

    @precondition(lambda self: any(s.num_uncomputed == 1 for s in self.running))
    @rule(pick=st.integers(0, 99), num_drafts=st.integers(0, 9), num_accepted=st.integers(0, 9))
    def verify_drafts(self, pick: int, num_drafts: int, num_accepted: int) -> None:
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        seq = decoding[pick % len(decoding)]
        if not self._make_room(seq, seq.num_tokens):
            return
        num_free = self.kv.pool.num_free
        granted = self.kv.reserve_drafts(seq, num_drafts, num_scheduled=seq.num_computed)
        assert 0 <= granted <= num_drafts
        assert seq.num_tokens + granted <= len(seq.block_ids) * BS, "a granted draft has no slot"
        if self.kv.pool.num_free < num_free:
            assert self.kv.pool.num_free >= self.kv.watermark_blocks
        accepted = min(num_accepted, granted)
        for _ in range(accepted + 1):  # the accepted drafts and the token after them
            seq.output_ids.append(next_token(seq.tokens))
        seq.num_computed += 1 + accepted
        self.kv.commit_full_blocks(seq)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def release_early(self, pick: int) -> None:
        """A plan computing every known token and sampling the last allowed one is sent."""
        seq = self.running[pick % len(self.running)]
        if not self._make_room(seq, seq.num_tokens):
            return
        self.kv.release_early(seq, num_scheduled=seq.num_tokens)
        assert seq.block_ids == []
        self.running.remove(seq)
        self.draining.append(seq)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick: int) -> None:
        self._preempt(self.running[pick % len(self.running)])

    @precondition(lambda self: self.waiting or self.running or self.draining)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick: int) -> None:
        """A stop, a cancel, or the plan in flight's last token: its blocks all go back."""
        seq = self.live[pick % len(self.live)]
        for queue in (self.waiting, self.running, self.draining):
            if seq in queue:
                queue.remove(seq)
        num_sole = sum(1 for b in seq.block_ids if self.kv.pool.refs(b) == 1)
        num_free = self.kv.pool.num_free
        self.kv.release(seq)
        assert seq.block_ids == [] and self.kv.pool.num_free == num_free + num_sole

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        while True:
            held, num_free = list(seq.block_ids), self.kv.pool.num_free
            if self.kv.grow(seq, num_tokens):
                return True
            assert (seq.block_ids, self.kv.pool.num_free) == (held, num_free)
            others = [s for s in self.running if s is not seq and s.block_ids]
            self._preempt(others[-1] if others else seq)
            if not others:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        self.waiting.insert(0, seq)

    # -- invariants ---------------------------------------------------------------------

    def _holders(self) -> defaultdict[int, list[tuple[Sequence, int]]]:
        """Each block's holders: the sequences whose tables list it, and where."""
        holders: defaultdict[int, list[tuple[Sequence, int]]] = defaultdict(list)
        for seq in self.live:
            for i, block in enumerate(seq.block_ids):
                holders[block].append((seq, i))
        return holders

    @invariant()
    def blocks_are_counted_once_per_table(self) -> None:
        pool = self.kv.pool
        for seq in self.live:
            assert len(seq.block_ids) == len(set(seq.block_ids)), "a block twice in one table"
        holders = self._holders()
        states = pool.state_map()
        for block in range(pool.num_blocks):
            assert pool.refs(block) == len(holders[block]), f"block {block} miscounted"
            assert (states[block] == "U") == bool(holders[block])
        assert pool.num_used == sum(1 for owners in holders.values() if owners)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert states.count("C") == pool.num_cached

    @invariant()
    def only_equal_prefixes_share_a_block(self) -> None:
        for block, [(first, i), *others] in self._holders().items():
            for other, j in others:
                assert self.kv.pool.enable_prefix_cache, f"block {block} shared, cache off"
                assert i == j and first.cache_salt == other.cache_salt
                assert i < min(len(first.block_keys), len(other.block_keys)), "shared uncached"
                assert first.block_keys[i] == other.block_keys[i]
                assert first.tokens[: (i + 1) * BS] == other.tokens[: (i + 1) * BS]

    @invariant()
    def keys_chain_over_each_sequences_own_tokens(self) -> None:
        for seq in self.waiting:
            assert (seq.block_ids, seq.block_keys, seq.num_computed) == ([], [], 0)
        for seq in self.running:
            assert seq.num_computed <= len(seq.block_ids) * BS
            assert len(seq.block_keys) == seq.num_computed // BS
        for seq in [*self.running, *self.draining]:
            parent = self.kv.pool.root_for(seq.cache_salt)
            for i, key in enumerate(seq.block_keys):
                parent = chain_key(parent, seq.tokens[i * BS : (i + 1) * BS])
                assert key == parent, f"block {i}'s key is not its tokens'"

    def teardown(self) -> None:
        for seq in self.live:
            self.kv.release(seq)
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks, f"leaked: {pool.state_map()}"
        assert all(pool.refs(b) == 0 for b in range(pool.num_blocks))


KVModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManager = KVModel.TestCase
