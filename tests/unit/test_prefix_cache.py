"""Prefix caching: shared blocks, reference counts, LRU eviction, and exact outputs.

The fake worker here keeps real slot contents: each sampled token is a function of the
tokens it reads back from its block table, so a block shared by mistake changes the output.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from canteen.batching import BatchConfig
from canteen.plan import SampledToken, Sampling, StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool, chain_key
from scheduler.sequence import Sequence

BS = 4

# the step semantics tested here
ONE_AT_A_TIME: dict[str, Any] = {"max_step_stall": 0.0, "pipeline_depth": 1}


def next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 97 + 3


def expected(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class KVWorker:
    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.seqs: dict[str, tuple[list[int], list[int], list[int]]] = {}
        self.new_cached: dict[str, int] = {}

    def step(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.dropped_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_sequences:
            self.seqs[new.seq_id] = (
                list(new.token_ids),
                list(new.block_ids),
                [new.num_cached_tokens],
            )
            self.new_cached[new.seq_id] = new.num_cached_tokens
        out = []
        for item in plan.scheduled:
            tokens, blocks, computed = self.seqs[item.seq_id]
            blocks.extend(item.new_block_ids)
            start, end = computed[0], computed[0] + item.num_tokens
            for p in range(start, end):
                self.slots[blocks[p // BS] * BS + p % BS] = tokens[p]
            computed[0] = end
            if end == len(tokens):
                context = [self.slots[blocks[p // BS] * BS + p % BS] for p in range(end)]
                token = next_token(context)
                tokens.append(token)
                out.append(SampledToken(item.seq_id, token, 0.0))
        return StepResult(plan.step_id, tuple(out), plan.num_tokens)


def make(num_blocks: int = 32, enable: bool = True) -> BatchScheduler:
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=enable, cache_salt="m:v1")
    return BatchScheduler(pool, BatchConfig(max_batched_tokens=64, max_num_seqs=8, **ONE_AT_A_TIME))


def seq(rid: str, prompt: list[int], max_tokens: int = 6) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens, Sampling(temperature=0.0), seq_id=rid)


def run(sched: BatchScheduler, worker: KVWorker, limit: int = 500) -> None:
    for _ in range(limit):
        plan = sched.schedule()
        if plan is None:
            return
        sched.update(worker.step(plan))
    raise AssertionError("did not finish")


PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]


def test_a_finished_prefix_is_reused_and_outputs_stay_exact() -> None:
    sched, worker = make(), KVWorker()
    a = seq("a", [*PREFIX, 1, 2])
    sched.add(a)
    run(sched, worker)
    b = seq("b", [*PREFIX, 5, 6, 7])
    sched.add(b)
    run(sched, worker)
    assert a.output_ids == expected(a.prompt_ids, 6)
    assert b.output_ids == expected(b.prompt_ids, 6)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert worker.new_cached["b"] == 8
    assert sched.prefix_cache_hit_rate == 8 / (10 + 11)


def test_running_sequences_share_blocks_by_reference() -> None:
    sched, worker = make(), KVWorker()
    a = seq("a", [*PREFIX, 1], max_tokens=20)
    sched.add(a)
    for _ in range(2):
        sched.update(worker.step(sched.schedule()))  # type: ignore[arg-type]
    b = seq("b", [*PREFIX, 9], max_tokens=3)
    sched.add(b)
    sched.update(worker.step(sched.schedule()))  # type: ignore[arg-type]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [sched.pool.refs(x) for x in a.block_ids[:2]] == [2, 2]
    run(sched, worker)
    assert b.output_ids == expected(b.prompt_ids, 3)
    assert a.output_ids == expected(a.prompt_ids, 20)
    assert sched.pool.num_free == sched.pool.num_blocks
    assert all(sched.pool.refs(x) == 0 for x in range(sched.pool.num_blocks))


def test_the_last_prompt_token_is_always_computed() -> None:
    sched, worker = make(), KVWorker()
    sched.add(seq("a", PREFIX))  # exactly two full blocks
    run(sched, worker)
    again = seq("b", PREFIX)
    sched.add(again)
    run(sched, worker)
    assert again.num_cached_tokens == 4  # one block, not both: the last token is computed
    assert again.output_ids == expected(PREFIX, 6)


def test_unreferenced_cached_blocks_are_evicted_least_recently_used() -> None:
    sched, worker = make(num_blocks=5), KVWorker()
    old, new = [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]
    for rid, prompt in (("old", old), ("new", new)):
        sched.add(seq(rid, prompt, max_tokens=2))
        run(sched, worker)
    assert sched.pool.num_cached == 2  # one full, computed block of each
    big = seq("big", [41, 42, 43, 44, 45, 46, 47, 48, 49, 50], max_tokens=6)
    sched.add(big)
    run(sched, worker)
    assert big.output_ids == expected(big.prompt_ids, 6)
    again_new, again_old = seq("n2", new, 1), seq("o2", old, 1)
    for s in (again_new, again_old):
        sched.add(s)
        run(sched, worker)
    assert again_new.num_cached_tokens == 4
    assert again_old.num_cached_tokens == 0  # evicted first (least recently used)
    assert again_new.output_ids == expected(new, 1)


def test_cache_off_and_other_versions_never_share() -> None:
    sched, worker = make(enable=False), KVWorker()
    for rid in ("a", "b"):
        sched.add(seq(rid, [*PREFIX, 1]))
        run(sched, worker)
    assert sched.num_cached_prompt_tokens == 0 and sched.pool.num_cached == 0
    p1 = BlockPool(4, BS, True, cache_salt="m:v1")
    p2 = BlockPool(4, BS, True, cache_salt="m:v2")
    assert chain_key(p1.root_key, PREFIX[:4]) != chain_key(p2.root_key, PREFIX[:4])


def test_a_preempted_sequence_resumes_from_its_own_cached_blocks() -> None:
    pool = BlockPool(6, BS, enable_prefix_cache=True, cache_salt="m:v1")
    sched = BatchScheduler(
        pool,
        BatchConfig(max_batched_tokens=64, max_num_seqs=8, watermark_blocks=0, **ONE_AT_A_TIME),
    )
    worker = KVWorker()
    low, high = seq("low", [1, 2, 3, 4, 5], 12), seq("high", [6, 7, 8, 9, 10], 12)
    high.priority = 1
    for s in (low, high):
        sched.add(s)
    run(sched, worker)
    assert sched.num_preemptions >= 1
    assert low.output_ids == expected(low.prompt_ids, 12)
    assert high.output_ids == expected(high.prompt_ids, 12)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(1, 8), st.booleans()),
        min_size=1,
        max_size=14,
    ),
    st.integers(6, 24),
)
def test_accounting_and_outputs_hold_under_random_sharing(
    specs: list[tuple[int, int, int, bool]], num_blocks: int
) -> None:
    prefixes = [[50 + i for i in range(8)], [70 + i for i in range(6)], [90, 91, 92, 93]]
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=True, cache_salt="m:v1")
    sched = BatchScheduler(
        pool, BatchConfig(max_batched_tokens=16, max_num_seqs=4, **ONE_AT_A_TIME)
    )
    worker = KVWorker()
    seqs = []
    for i, (which, tail, max_tokens, cancel) in enumerate(specs):
        prompt = prefixes[which] + [200 + i + j for j in range(tail)]
        if pool.blocks_for(len(prompt) + max_tokens) > num_blocks:
            continue
        s = seq(f"s{i}", prompt, max_tokens)
        seqs.append((s, cancel))
        sched.add(s)
        plan = sched.schedule()
        if plan is not None:
            sched.update(worker.step(plan))
        if cancel:
            sched.cancel(s)
        referenced = {b for r in sched.running for b in r.block_ids}
        assert pool.num_free + len(referenced) == num_blocks
    run(sched, worker, limit=2000)
    for s, cancel in seqs:
        if not cancel:
            assert s.output_ids == expected(s.prompt_ids, s.max_tokens), s.request_id
    assert pool.num_free == num_blocks
    assert all(pool.refs(b) == 0 for b in range(num_blocks))
