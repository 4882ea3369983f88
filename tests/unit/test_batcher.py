"""The batch scheduler on a real block pool, driven by a fake worker that checks every plan."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canteen.batching import BatchConfig
from canteen.finish import Finish
from canteen.plan import SampledToken, Sampling, StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.sequence import SeqEvent, Sequence, Status

BLOCK_SIZE = 4


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = BLOCK_SIZE,
    max_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    watermark_blocks: int = 1,
) -> BatchScheduler:
    # One plan at a time and no stall bound: the step semantics these tests pin down
    # (tests/unit/test_pipeline.py and test_cost.py cover the other two).
    limits = BatchConfig(
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        watermark_blocks=watermark_blocks,
        max_step_stall=0,
        pipeline_depth=1,
    )
    return BatchScheduler(BlockPool(num_blocks, block_size), limits)


def make_seq(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    priority: int = 0,
    stop_token_ids: frozenset[int] = frozenset(),
    arrival_time: float = 0.0,
) -> Sequence:
    start = 100 + 13 * (sum(map(ord, request_id)) % 7)
    return Sequence(
        request_id=request_id,
        seq_id=request_id,  # the scheduler's own id; named like the label here for reading
        prompt_ids=[start + i for i in range(prompt_len)],
        max_tokens=max_tokens,
        sampling=Sampling(temperature=0.0),
        stop_token_ids=stop_token_ids,
        priority=priority,
        arrival_time=arrival_time,
    )


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the sequence so far."""
    return (tokens[-1] * 7 + len(tokens)) % 50 + 10


def expected_tokens(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class WorkerSeq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


class FakeWorker:
    """Applies plans the way worker/engine/runner.py does and asserts what it enforces."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seqs: dict[str, WorkerSeq] = {}
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in plan.dropped_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_sequences:
            assert new.seq_id not in self.seqs, f"{new.seq_id} sent twice"
            self.seqs[new.seq_id] = WorkerSeq(
                list(new.token_ids), list(new.block_ids), new.num_cached_tokens
            )
        named = [item.seq_id for item in plan.scheduled]
        assert len(named) == len(set(named)), f"a sequence is scheduled twice: {named}"
        for item in plan.scheduled:
            assert item.seq_id in self.seqs, f"{item.seq_id} is not known to the worker"
            seq = self.seqs[item.seq_id]
            seq.block_ids.extend(item.new_block_ids)
            end = seq.num_computed + item.num_tokens
            assert item.num_tokens > 0
            assert end <= len(seq.tokens), f"{item.seq_id}: {end} > {len(seq.tokens)} tokens"
            assert end <= len(seq.block_ids) * self.block_size, f"{item.seq_id}: blocks short"
        held = [b for seq in self.seqs.values() for b in seq.block_ids]
        assert len(held) == len(set(held)), f"a block is held by two sequences: {sorted(held)}"
        assert all(0 <= b < self.num_blocks for b in held)
        tokens = []
        for item in plan.scheduled:
            seq = self.seqs[item.seq_id]
            seq.num_computed += item.num_tokens
            if seq.num_computed == len(seq.tokens):
                token = next_token(seq.tokens)
                seq.tokens.append(token)
                tokens.append(SampledToken(item.seq_id, token, 0.0))
        return StepResult(plan.step_id, tuple(tokens), num_tokens=plan.num_tokens)


def step(sched: BatchScheduler, worker: FakeWorker) -> tuple[StepPlan | None, list[SeqEvent]]:
    plan = sched.schedule()
    if plan is None:
        return None, []
    return plan, sched.update(worker.step(plan))


def run_until_done(sched: BatchScheduler, worker: FakeWorker, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_work:
            return
        step(sched, worker)
        assert_pool_consistent(sched)
    raise AssertionError(f"still working after {max_steps} steps")


def assert_pool_consistent(sched: BatchScheduler) -> None:
    pool = sched.pool
    held = [b for seq in sched.running for b in seq.block_ids]
    assert pool.num_free + len(held) == pool.num_blocks
    assert len(held) == len(set(held)), f"a block is in two sequences: {sorted(held)}"
    assert all(not seq.block_ids for seq in sched.waiting)


def scheduled(plan: StepPlan) -> dict[str, int]:
    return {item.seq_id: item.num_tokens for item in plan.scheduled}


def run_alone(prompt_len: int, max_tokens: int, request_id: str) -> list[int]:
    sched, worker = make_scheduler(num_blocks=256), FakeWorker(256)
    seq = make_seq(request_id, prompt_len, max_tokens)
    sched.add(seq)
    run_until_done(sched, worker)
    return seq.output_ids


# -- continuous batching ------------------------------------------------------------------


def test_request_joins_next_plan_while_another_decodes() -> None:
    sched, worker = make_scheduler(), FakeWorker(64)
    a = make_seq("a", prompt_len=5, max_tokens=10)
    sched.add(a)
    step(sched, worker)  # prefill of a
    step(sched, worker)  # a decodes
    assert a.is_decoding and len(a.output_ids) == 2

    b = make_seq("b", prompt_len=3, max_tokens=10)
    sched.add(b)
    plan, _ = step(sched, worker)

    assert plan is not None
    assert [n.seq_id for n in plan.new_sequences] == ["b"]
    assert scheduled(plan) == {"a": 1, "b": 3}
    assert len(a.output_ids) == 3 and len(b.output_ids) == 1


def test_finished_sequence_leaves_batch_frees_blocks_and_is_dropped_next() -> None:
    sched, worker = make_scheduler(num_blocks=32), FakeWorker(32)
    short = make_seq("short", prompt_len=4, max_tokens=2)
    long = make_seq("long", prompt_len=4, max_tokens=10)
    sched.add(short)
    sched.add(long)

    step(sched, worker)  # prefill both; each samples its first token
    plan, events = step(sched, worker)  # short samples its second (last) token

    assert plan is not None and scheduled(plan) == {"short": 1, "long": 1}
    assert [e.finish for e in events if e.seq_id == short.seq_id] == [Finish.LENGTH]
    assert short.finish is Finish.LENGTH and short.status is Status.FINISHED
    assert short.output_ids == expected_tokens(short.prompt_ids, 2)
    assert short.block_ids == [] and sched.running == [long]
    assert sched.pool.num_free == 32 - len(long.block_ids)

    plan, _ = step(sched, worker)
    assert plan is not None
    assert plan.dropped_seq_ids == ("short",)
    assert scheduled(plan) == {"long": 1}
    assert "short" not in worker.seqs


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched, worker = make_scheduler(max_num_seqs=2), FakeWorker(64)
    seqs = [make_seq(f"s{i}", prompt_len=3, max_tokens=3, arrival_time=i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)

    plan, _ = step(sched, worker)
    assert plan is not None and scheduled(plan) == {"s0": 3, "s1": 3}
    assert sched.waiting == [seqs[2]]

    run_until_done(sched, worker)
    assert all(len(plan.scheduled) <= 2 for plan in worker.plans)
    assert [s.output_ids for s in seqs] == [expected_tokens(s.prompt_ids, 3) for s in seqs]


# -- deltas -------------------------------------------------------------------------------


def test_plans_send_a_sequence_once_then_only_deltas() -> None:
    sched, worker = make_scheduler(), FakeWorker(64)
    seq = make_seq("a", prompt_len=6, max_tokens=12)
    sched.add(seq)
    run_until_done(sched, worker)

    first, *rest = worker.plans
    assert [n.seq_id for n in first.new_sequences] == ["a"]
    assert first.new_sequences[0].token_ids == tuple(seq.prompt_ids)
    assert len(first.new_sequences[0].block_ids) == 2  # 6 tokens in blocks of 4
    assert scheduled(first) == {"a": 6}
    decode_plans = rest[:-1]  # the last plan only drops "a"
    assert len(decode_plans) == 11
    for offset, plan in enumerate(decode_plans):
        position = 6 + offset  # the token this step computes
        assert plan.new_sequences == ()
        (item,) = plan.scheduled
        assert item.num_tokens == 1
        assert bool(item.new_block_ids) == (position % BLOCK_SIZE == 0), position
    assert rest[-1].scheduled == () and rest[-1].dropped_seq_ids == ("a",)
    sent = [b for p in worker.plans for s in p.scheduled for b in s.new_block_ids]
    assert len(first.new_sequences[0].block_ids) + len(sent) == 5  # 17 computed tokens
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 12)


# -- chunked prefill ----------------------------------------------------------------------


def test_long_prompt_alone_is_prefilled_in_budget_sized_chunks() -> None:
    sched, worker = make_scheduler(max_batched_tokens=8), FakeWorker(64)
    seq = make_seq("long", prompt_len=20, max_tokens=3)
    sched.add(seq)
    run_until_done(sched, worker)

    chunks = [scheduled(p).get("long") for p in worker.plans]
    assert chunks == [8, 8, 4, 1, 1, None]
    new_blocks = [len(p.scheduled[0].new_block_ids) for p in worker.plans[1:5]]
    assert len(worker.plans[0].new_sequences[0].block_ids) == 2
    assert new_blocks == [2, 1, 1, 0]  # 16, 20, 21, 22 tokens in blocks of 4
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 3)


def test_decodes_come_before_prefill_chunks_within_budget() -> None:
    sched, worker = make_scheduler(max_batched_tokens=8), FakeWorker(64)
    a = make_seq("a", prompt_len=3, max_tokens=30)
    b = make_seq("b", prompt_len=2, max_tokens=30)
    sched.add(a)
    sched.add(b)
    step(sched, worker)  # both prefill and start decoding
    long = make_seq("long", prompt_len=20, max_tokens=2)
    sched.add(long)

    chunks = []
    while long.num_computed < 20:
        plan, _ = step(sched, worker)
        assert plan is not None
        assert plan.num_tokens <= 8
        assert [s.seq_id for s in plan.scheduled[:2]] == ["a", "b"]
        assert scheduled(plan)["a"] == 1 and scheduled(plan)["b"] == 1
        chunks.append(scheduled(plan)["long"])

    assert chunks == [6, 6, 6, 2]
    run_until_done(sched, worker)
    assert long.output_ids == expected_tokens(long.prompt_ids, 2)
    assert a.output_ids == expected_tokens(a.prompt_ids, 30)


# -- stop tokens --------------------------------------------------------------------------


def test_stop_token_finishes_with_stop_and_is_not_emitted() -> None:
    prompt_len = 5
    probe = make_seq("a", prompt_len, max_tokens=1)
    natural = expected_tokens(probe.prompt_ids, 6)
    stop = natural[3]
    assert stop not in natural[:3]
    sched, worker = make_scheduler(), FakeWorker(64)
    seq = make_seq("a", prompt_len, max_tokens=50, stop_token_ids=frozenset({stop}))
    sched.add(seq)

    events: list[SeqEvent] = []
    while sched.has_work:
        events += step(sched, worker)[1]

    assert seq.finish is Finish.STOP
    assert seq.output_ids == natural[:3]
    assert [e.token_ids for e in events] == [(t,) for t in natural[:3]] + [()]
    assert events[-1].finish is Finish.STOP
    assert sched.pool.num_free == 64


def test_max_tokens_finishes_with_length() -> None:
    sched, worker = make_scheduler(), FakeWorker(64)
    seq = make_seq("a", prompt_len=4, max_tokens=4)
    sched.add(seq)
    run_until_done(sched, worker)
    assert seq.finish is Finish.LENGTH
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 4)


def test_max_model_len_finishes_with_length() -> None:
    sched, worker = make_scheduler(), FakeWorker(64)
    seq = make_seq("a", prompt_len=5, max_tokens=100)
    seq.max_model_len = 8
    sched.add(seq)
    run_until_done(sched, worker)
    assert seq.finish is Finish.LENGTH
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 3)


def test_update_rejects_a_result_for_another_step() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=4, max_tokens=4))
    plan = sched.schedule()
    assert plan is not None
    with pytest.raises(ValueError, match=f"result for step {plan.step_id + 1}"):
        sched.update(StepResult(plan.step_id + 1))


# -- cancel -------------------------------------------------------------------------------


def test_cancel_waiting_sequence_removes_it_at_once() -> None:
    sched = make_scheduler()
    seq = make_seq("a", prompt_len=4, max_tokens=4)
    sched.add(seq)
    sched.cancel(seq)
    assert seq.finish is Finish.CANCELLED and sched.waiting == []
    assert not sched.has_work and sched.schedule() is None


def test_cancel_running_sequence_between_steps_frees_blocks_now() -> None:
    sched, worker = make_scheduler(num_blocks=16), FakeWorker(16)
    seq = make_seq("a", prompt_len=9, max_tokens=8)
    sched.add(seq)
    step(sched, worker)
    assert sched.pool.num_free == 16 - 3

    sched.cancel(seq)

    assert seq.finish is Finish.CANCELLED and seq.block_ids == []
    assert sched.pool.num_free == 16 and sched.running == []
    plan, _ = step(sched, worker)
    assert plan is not None and plan.dropped_seq_ids == ("a",) and plan.scheduled == ()
    assert worker.seqs == {} and not sched.has_work


def test_a_lost_worker_gives_back_its_sequences_with_their_tokens_and_counts_the_loss() -> None:
    sched, worker = make_scheduler(num_blocks=16), FakeWorker(16)
    seq, leaving = make_seq("a", prompt_len=5, max_tokens=8), make_seq("b", 2, 8)
    sched.add(seq, "w1")
    sched.add(leaving, "w1")
    assert seq.worker_id == "w1"
    step(sched, worker)
    made = list(seq.output_ids)
    assert sched.schedule() is not None
    sched.cancel(leaving)  # its plan is in flight: it ends when the worker answers
    assert sched.evict_all() == [seq]
    assert (seq.status, seq.output_ids, seq.block_ids, seq.num_failovers) == (
        Status.WAITING,
        made,
        [],
        1,
    )
    assert (leaving.status, leaving.finish) == (Status.FINISHED, Finish.CANCELLED)
    assert not sched.has_work


def test_cancel_while_plan_in_flight_frees_blocks_on_update() -> None:
    sched, worker = make_scheduler(num_blocks=16), FakeWorker(16)
    seq = make_seq("a", prompt_len=9, max_tokens=8)
    other = make_seq("b", prompt_len=2, max_tokens=8)
    sched.add(seq)
    sched.add(other)
    step(sched, worker)
    output_before = list(seq.output_ids)

    plan = sched.schedule()
    assert plan is not None and "a" in scheduled(plan)
    sched.cancel(seq)
    assert seq.block_ids != [] and seq.finish is None  # the worker may still be writing them
    events = sched.update(worker.step(plan))

    assert seq.finish is Finish.CANCELLED and seq.block_ids == []
    assert seq.output_ids == output_before  # the token sampled in flight is discarded
    assert [e.finish for e in events if e.seq_id == seq.seq_id][-1] is Finish.CANCELLED
    assert sched.pool.num_free == 16 - len(other.block_ids)
    plan, _ = step(sched, worker)
    assert plan is not None and plan.dropped_seq_ids == ("a",)
    assert scheduled(plan) == {"b": 1}


# -- preemption ---------------------------------------------------------------------------


def test_pool_pressure_preempts_most_recent_and_outputs_match_running_alone() -> None:
    # Each sequence alone needs 5 blocks (6 + 11 computed tokens); two need 10 of 6.
    sched, worker = make_scheduler(num_blocks=6), FakeWorker(6)
    a = make_seq("a", prompt_len=6, max_tokens=12, arrival_time=0)
    b = make_seq("b", prompt_len=6, max_tokens=12, arrival_time=1)
    sched.add(a)
    sched.add(b)

    preempted_at = None
    while sched.has_work:
        before = list(b.output_ids)
        plan, _ = step(sched, worker)
        assert_pool_consistent(sched)
        if preempted_at is None and sched.num_preemptions:
            preempted_at = before
            assert plan is not None and "b" in plan.dropped_seq_ids
            assert b.status is Status.WAITING and b.block_ids == [] and b.num_computed == 0
            assert a.status is Status.RUNNING
        assert len(worker.plans) < 200

    assert sched.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert preempted_at is not None and 0 < len(preempted_at) < 12
    resent = [n for p in worker.plans for n in p.new_sequences if n.seq_id == "b"]
    assert len(resent) == 2
    assert resent[1].token_ids == tuple(b.prompt_ids + preempted_at)
    assert resent[1].num_cached_tokens == 0
    assert a.output_ids == run_alone(6, 12, "a")
    assert b.output_ids == run_alone(6, 12, "b")
    assert sched.pool.num_free == 6 and worker.seqs == {}


def test_preemption_picks_the_lowest_priority_sequence_not_the_newest() -> None:
    sched, worker = make_scheduler(num_blocks=6), FakeWorker(6)
    low = make_seq("low", prompt_len=6, max_tokens=12, priority=0)
    high = make_seq("high", prompt_len=6, max_tokens=12, priority=5)
    sched.add(low)
    step(sched, worker)  # low is admitted first
    sched.add(high)
    run_until_done(sched, worker)

    assert low.num_preemptions == 1 and high.num_preemptions == 0
    assert low.output_ids == run_alone(6, 12, "low")
    assert high.output_ids == run_alone(6, 12, "high")
    # high never waits: it computes in every plan from its admission until it finishes
    high_steps = [scheduled(p).get("high") for p in worker.plans]
    first = high_steps.index(6)
    assert high_steps[first : first + 12] == [6] + [1] * 11


# -- the pool invariant -------------------------------------------------------------------

# Small enough that a few growing sequences preempt each other; one alone always fits
# (16 + 9 computed tokens need 7 blocks).
NUM_BLOCKS = 8

# kind, prompt length, max tokens, priority, which live sequence to cancel; steps are the
# most common so that sequences grow into each other.
KINDS = ["add", "add", "step", "step", "step", "step", "step", "cancel", "cancel_in_flight"]
ops = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(1, 16),
        st.integers(1, 10),
        st.integers(0, 2),
        st.integers(0, 100),
    ),
    min_size=20,
    max_size=80,
)


def assert_invariant(sched: BatchScheduler, seqs: list[Sequence]) -> None:
    assert_pool_consistent(sched)
    held = [b for s in seqs for b in s.block_ids]
    assert len(held) == len(set(held))
    assert all(not s.block_ids for s in seqs if s.status is not Status.RUNNING)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_blocks_are_never_lost_or_shared(operations: list[tuple[str, int, int, int, int]]) -> None:
    sched = make_scheduler(num_blocks=NUM_BLOCKS, max_batched_tokens=8)
    worker = FakeWorker(NUM_BLOCKS)
    seqs: list[Sequence] = []
    for kind, prompt_len, max_tokens, priority, pick in operations:
        live = [s for s in seqs if not s.is_finished]
        if kind == "add":
            seq = make_seq(
                f"r{len(seqs)}", prompt_len, max_tokens, priority, arrival_time=len(seqs)
            )
            seqs.append(seq)
            sched.add(seq)
        elif kind == "step":
            step(sched, worker)
        elif kind == "cancel" and live:
            sched.cancel(live[pick % len(live)])
        elif kind == "cancel_in_flight" and live:
            plan = sched.schedule()
            sched.cancel(live[pick % len(live)])
            if plan is not None:
                sched.update(worker.step(plan))
        assert_invariant(sched, seqs)

    for seq in seqs:
        sched.cancel(seq)
        assert_invariant(sched, seqs)
    run_until_done(sched, worker, max_steps=5)
    assert sched.pool.num_free == NUM_BLOCKS
    assert worker.seqs == {}
    for seq in seqs:
        assert seq.is_finished
        assert seq.output_ids == expected_tokens(seq.prompt_ids, len(seq.output_ids))
