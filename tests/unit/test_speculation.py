"""Speculative decoding in the scheduler: grants and block accounting, and the learned rule
(the worker's side: tests/unit/test_speculation_worker.py)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canteen.batching import BatchConfig
from canteen.finish import Finish
from canteen.plan import (
    SampledToken,
    StepPlan,
    StepResult,
)
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.sequence import Sequence
from scheduler.speculation import (
    MIN_MEASURED,
    RECORD_DECAY,
    TRY_STEPS,
    DraftRecord,
    SpeculationPolicy,
)
from tests.unit.test_batcher import BLOCK_SIZE, FakeWorker, expected_tokens, make_seq, next_token

K = 4


class DraftingWorker(FakeWorker):
    """Verifies drafts the way worker/engine/runner.py does: of ``k`` granted, the first
    ``hits()`` are right, so the step makes hits + 1 tokens."""

    def __init__(
        self,
        num_blocks: int,
        hits: Callable[[int], int] | None = None,
        proposes: Callable[[int], bool] = lambda step: True,
    ) -> None:
        super().__init__(num_blocks)
        self.hits = hits or (lambda k: k)
        self.proposes = proposes  # by step id: whether it has drafts to propose at all
        self.num_drafts = 0

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        tokens, drafts, accepted = list(result.tokens), 0, 0
        proposed = {s.seq_id: 0 for s in plan.scheduled if s.num_draft_tokens}
        for item in plan.scheduled:
            seq = self.seqs[item.seq_id]
            if item.num_draft_tokens == 0 or seq.num_computed + 1 != len(seq.tokens):
                continue
            room = len(seq.block_ids) * self.block_size - seq.num_computed
            assert item.num_draft_tokens <= room, "drafts granted without blocks"
            if not self.proposes(plan.step_id):
                continue
            k = proposed[item.seq_id] = item.num_draft_tokens
            hits = min(self.hits(k), k)
            drafts, accepted = drafts + k, accepted + hits
            for _ in range(hits):  # accepted drafts: computed, and the next draw made
                seq.num_computed += 1
                token = next_token(seq.tokens)
                seq.tokens.append(token)
                tokens.append(SampledToken(item.seq_id, token, 0.0))
        tokens.sort(key=lambda t: [s.seq_id for s in plan.scheduled].index(t.seq_id))
        self.num_drafts += drafts
        return StepResult(
            plan.step_id,
            tuple(tokens),
            num_tokens=plan.num_tokens + drafts,
            total_ns=1_000_000,
            num_draft_tokens=drafts,
            num_accepted_tokens=accepted,
            num_proposed=proposed,
        )


def speculating(num_blocks: int = 64, depth: int = 2) -> BatchScheduler:
    limits = BatchConfig(
        max_batched_tokens=64, max_num_seqs=16, max_step_stall=0, pipeline_depth=depth
    )
    return BatchScheduler(BlockPool(num_blocks, BLOCK_SIZE), limits, num_draft_tokens=K)


def drive(sched: BatchScheduler, worker: FakeWorker, seqs: list[Sequence]) -> None:
    for _ in range(2000):
        if all(s.is_finished for s in seqs) and not sched.has_work:
            return
        plans = []
        while (plan := sched.schedule()) is not None:
            plans.append(plan)
        for plan in plans:
            sched.update(worker.step(plan))
            for seq in sched.running:  # never more than the tokens and two steps of drafts
                # (one in flight whose drafts might all hold, and one planned behind it)
                assert len(seq.block_ids) <= sched.pool.blocks_for(seq.num_tokens + 2 * (K + 1))
    raise AssertionError("did not finish")


def test_accepted_drafts_make_several_tokens_a_step_and_the_same_output() -> None:
    sched, worker = speculating(), DraftingWorker(64)
    seq = make_seq("a", prompt_len=5, max_tokens=21)
    sched.add(seq)
    drive(sched, worker, [seq])
    assert seq.finish is Finish.LENGTH
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 21)
    decodes = [s for p in worker.plans for s in p.scheduled if s.num_draft_tokens]
    # 1 prefill, 4 steps measured without drafts, then up to 5 tokens a step
    assert decodes and len(worker.plans) <= 10
    assert sched.pool.num_free == 64
    assert sched.speculation.num_accepted_tokens == worker.num_drafts


def test_the_plan_after_one_that_verifies_drafts_is_sent_before_it_returns() -> None:
    """A drafting step makes 1 to K + 1 tokens; the plan behind it assumes all K hold (its
    blocks and its drafts' room cover them), so the worker never waits for a round trip,
    and the output is exact whether the drafts hold or not."""
    for hits in (K, 0, 2):
        sched, worker = speculating(), DraftingWorker(64, hits=partial(min, hits))
        seq = make_seq("a", prompt_len=5, max_tokens=30)
        sched.add(seq)
        sent: deque[StepPlan] = deque()
        drafting_behind_drafting = 0
        for _ in range(200):
            while (plan := sched.schedule()) is not None:
                if sent and plan.scheduled and any(s.num_draft_tokens for s in sent[-1].scheduled):
                    drafting_behind_drafting += 1
                sent.append(plan)
            if not sent:
                break
            sched.update(worker.step(sent.popleft()))
        assert drafting_behind_drafting > 0
        assert seq.output_ids == expected_tokens(seq.prompt_ids, 30)
        assert sched.pool.num_free == 64 and not sched.running


def test_drafts_wait_while_a_prompt_waits_for_its_prefill() -> None:
    """A drafting step lasts several plain ones: a stream drafts alone, stops drafting while
    a new prompt waits and prefills (in two chunks here), drafts again once both decode, and
    both answers are exact."""
    sched, worker = speculating(depth=1), DraftingWorker(64)
    a = make_seq("a", prompt_len=5, max_tokens=80)
    sched.add(a)

    def step() -> StepPlan:
        plan = sched.schedule()
        assert plan is not None
        sched.update(worker.step(plan))
        return plan

    def drafting(plan: StepPlan) -> bool:
        return any(s.num_draft_tokens for s in plan.scheduled)

    assert any(drafting(step()) for _ in range(10))
    b = make_seq("b", prompt_len=100, max_tokens=30)  # 100 tokens: two steps of at most 64
    sched.add(b)
    while_b_waits = []
    while not b.output_ids:
        while_b_waits.append(step())
        assert len(while_b_waits) < 10
    assert len(while_b_waits) >= 2 and not any(map(drafting, while_b_waits))
    assert any(drafting(step()) for _ in range(10))
    drive(sched, worker, [a, b])
    assert a.output_ids == expected_tokens(a.prompt_ids, 80)
    assert b.output_ids == expected_tokens(b.prompt_ids, 30)
    assert sched.pool.num_free == 64


def test_a_stop_token_inside_an_accepted_run_ends_the_answer_there() -> None:
    probe = make_seq("s", prompt_len=6, max_tokens=50)
    stop = expected_tokens(probe.prompt_ids, 7)[6]
    sched, worker = speculating(), DraftingWorker(64)
    seq = make_seq("s", prompt_len=6, max_tokens=50, stop_token_ids=frozenset({stop}))
    sched.add(seq)
    drive(sched, worker, [seq])
    assert seq.finish is Finish.STOP
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 6)
    assert sched.pool.num_free == 64


def test_max_tokens_is_never_passed_by_a_run_of_drafts() -> None:
    for max_tokens in range(1, 12):
        sched, worker = speculating(), DraftingWorker(64)
        seq = make_seq("m", prompt_len=3, max_tokens=max_tokens)
        sched.add(seq)
        drive(sched, worker, [seq])
        assert seq.output_ids == expected_tokens(seq.prompt_ids, max_tokens)
        granted = [s.num_draft_tokens for p in worker.plans for s in p.scheduled]
        assert max(granted) <= max(max_tokens - 2, 0)  # after the prefill's token


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 30)), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(8, 40),
)
def test_rejected_drafts_never_leak_a_block(
    lens: list[tuple[int, int]], seed: int, num_blocks: int
) -> None:
    rng = random.Random(seed)
    sched = speculating(num_blocks)
    worker = DraftingWorker(num_blocks, hits=lambda k: rng.randint(0, k))
    seqs = [make_seq(f"q{i}", p, m) for i, (p, m) in enumerate(lens)]
    fitting = [
        s for s in seqs if sched.pool.blocks_for(len(s.prompt_ids) + s.max_tokens) <= num_blocks
    ]
    for s in fitting:
        sched.add(s)
    drive(sched, worker, fitting)
    for s in fitting:
        assert s.output_ids == expected_tokens(s.prompt_ids, s.max_tokens)
    assert sched.pool.num_free == num_blocks and not sched.running


def _simulate(
    policy: SpeculationPolicy, n: int, steps: int, draft_cost: float, hits: int = K // 2
) -> float:
    """Decode steps of ``n`` new sequences on a worker whose step costs 20 ms + 1.5 ms a
    token (+ ``draft_cost`` when drafting) and where ``hits`` of each sequence's K drafts
    hold; returns the share of steps that drafted."""
    records = [DraftRecord() for _ in range(n)]
    drafted = 0
    for _ in range(steps):
        k = policy.drafts_for(n, records)
        seconds = 0.020 + 0.0015 * (n + n * k) + (draft_cost if k else 0.0)
        policy.observe(n, k > 0, seconds, n * k, n * min(hits, k))
        for record in records if k else ():
            record.observe(min(hits, k))
        drafted += k > 0
    return drafted / steps


def test_the_rule_turns_drafts_off_for_big_batches_and_on_again() -> None:
    policy = SpeculationPolicy(K)
    # n=2: 2 tokens in 23 ms, or 6 in 35 ms: drafts pay; n=32: 32 in 68 ms, or 96 in 260 ms
    assert _simulate(policy, 2, 128, 0.0) > 0.85  # after measuring both, a retry now and then
    assert _simulate(policy, 32, 128, 0.0) < 0.15
    assert _simulate(policy, 2, 128, 0.0) > 0.9  # the batch shrank: back on at once
    # a draft model that costs 60 ms a step never pays, whatever the batch
    costly = SpeculationPolicy(K)
    assert _simulate(costly, 1, 128, 0.060) < 0.15
    assert SpeculationPolicy(0).drafts_for(1, [DraftRecord()]) == 0


def test_a_request_whose_drafts_hold_drafts_after_requests_whose_drafts_missed() -> None:
    """One sequence at a time: requests whose drafts never hold teach the rule nothing about
    the next request's text, so a request whose drafts hold drafts from its first steps (the
    rule once kept one figure per batch size and turned drafts off for it too)."""
    policy = SpeculationPolicy(K)
    for _ in range(3):  # open-ended requests: no draft holds, drafts soon off
        assert _simulate(policy, 1, 100, 0.0, hits=0) < 0.15
    # 1 token in 21.5 ms against 1 + 4 in 27.5 ms: drafts that hold pay from the start
    assert _simulate(policy, 1, 5, 0.0, hits=K) == 1.0
    assert _simulate(policy, 1, 100, 0.0, hits=K) > 0.9
    # a batch of 1 whose request may not draft (or is constrained) never drafts
    assert policy.drafts_for(1, []) == 0


def test_a_batch_drafts_by_its_sequences_average_acceptance() -> None:
    """Eight sequences: drafting steps cost 2x here (break-even: one accepted draft per
    sequence), so two sequences whose drafts all hold among six that miss (one a step on
    average) do not pay, and six among two do."""
    policy = SpeculationPolicy(K)
    policy.observe(8, False, 0.010, 0, 0)
    policy.observe(8, True, 0.020, 8 * K, 0)  # a switch: not measured
    policy.observe(8, True, 0.020, 8 * K, 0)
    few = [DraftRecord(float(K))] * 2 + [DraftRecord(0.0)] * 6
    many = [DraftRecord(float(K))] * 6 + [DraftRecord(0.0)] * 2
    assert policy.drafts_for(8, few) == 0
    assert policy.drafts_for(8, many) == K
    record = DraftRecord()
    for accepted in (4, 0, 0, 0):
        record.observe(accepted)
    assert record.accepted == pytest.approx(4 * RECORD_DECAY**3)  # recent steps weigh most


def test_one_step_whose_drafts_all_miss_does_not_turn_drafts_off() -> None:
    """A sequence whose drafts hold 5 of 6 a step, on a worker where drafting steps cost 4x
    (break-even: 3 accepted drafts): one step that accepts none, as happens about one step in
    fourteen at 93% acceptance, leaves it drafting; three in a row turn drafts off."""
    policy = SpeculationPolicy(6)
    policy.observe(1, False, 0.010, 0, 0)
    policy.observe(1, True, 0.040, 6, 0)  # a switch: not measured
    policy.observe(1, True, 0.040, 6, 0)
    record = DraftRecord(5.0)
    record.observe(0)
    assert policy.drafts_for(1, [record]) == 6
    record.observe(0)
    record.observe(0)
    assert policy.drafts_for(1, [record]) == 0


def test_a_step_with_nothing_to_propose_does_not_turn_a_sequences_drafts_off() -> None:
    """An n-gram drafter has nothing to propose until the answer repeats its prompt: those
    steps make one token but say nothing of the drafts, so the sequence keeps drafting and
    its later drafts make several tokens a step. (Before, the first such step recorded "no
    draft held", and drafts stayed off until the rule's next try, 16 to 512 steps later.)"""
    sched = speculating()
    sched.speculation.observe(1, False, 0.010, 0, 0)  # plain steps measured: 10 ms
    sched.speculation.observe(1, True, 0.012, K, 0)  # a switch: not measured
    sched.speculation.observe(1, True, 0.012, K, 0)  # drafting: 12 ms, break-even 0.2
    worker = DraftingWorker(64, proposes=lambda step: step >= 5)
    seq = make_seq("a", prompt_len=5, max_tokens=40)
    sched.add(seq)
    drive(sched, worker, [seq])
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 40)
    granted = [p.step_id for p in worker.plans for s in p.scheduled if s.num_draft_tokens]
    assert {2, 3, 4} <= set(granted)  # steps with nothing to propose...
    assert seq.drafting.accepted == K  # ...left the record to the steps that proposed
    assert sched.speculation.num_accepted_tokens >= 24  # most tokens came from drafts
    assert len(worker.plans) <= 15


def test_drafts_that_could_not_pay_even_if_all_held_are_not_tried_again() -> None:
    """Two sequences whose drafts all hold, on a worker where a drafting step costs six plain
    ones (a costly draft model): even five tokens a sequence would lose, so after
    MIN_MEASURED measured drafting steps (one slow step alone does not convince the rule:
    test_speculation_outliers.py) it spends no step on drafts again."""
    policy = SpeculationPolicy(K)
    # 2 tokens in 23 ms, or 10 in 135 ms
    share = _simulate(policy, 2, 1000, 0.100, hits=K)
    assert 0 < share * 1000 <= MIN_MEASURED * TRY_STEPS


def test_a_busy_server_tries_drafts_only_once_a_smaller_batch_showed_they_pay() -> None:
    """Sixteen sequences from the start, on a worker where a drafting step costs a dozen
    plain ones: no batch below has shown drafts pay, so none is tried (each try would cost
    more than it could win), nor while the batch drains through 8 and 4; at 2 and 1 drafts
    are tried, and where they pay there, they are tried at 4 again."""
    policy = SpeculationPolicy(K)
    for n in (16, 8, 4):  # 16 tokens in 44 ms, or 80 in 540 ms
        assert _simulate(policy, n, 200, 0.400, hits=K) == 0.0
    assert _simulate(policy, 2, 50, 0.0, hits=K) > 0.9  # cheap drafts that hold pay at 2
    assert _simulate(policy, 4, 50, 0.0, hits=K) > 0.9  # and are now tried, and kept, at 4


def test_a_drafting_step_the_worker_waited_for_pays_for_its_round_trip() -> None:
    """Drafts that all miss make one token a step, as many as no drafts, in the same 1 ms of
    compute; but here the worker waits 5 ms before each drafting step (as it does where the
    plan behind a drafting one cannot be sent ahead: a sequence that would be done if its
    drafts all held). Judged by wall time between results, drafts lose and the rule turns
    them off; judged by compute alone it would keep them on (a tie goes to drafts)."""
    now = [0.0]
    limits = BatchConfig(max_batched_tokens=64, max_num_seqs=16, max_step_stall=0)
    sched = BatchScheduler(
        BlockPool(256, BLOCK_SIZE), limits, num_draft_tokens=K, clock=lambda: now[0]
    )
    worker = DraftingWorker(256, hits=lambda k: 0)
    seqs = [make_seq(f"s{i}", prompt_len=5, max_tokens=200) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    drafting = []
    for _ in range(150):
        plan = sched.schedule()
        assert plan is not None
        drafted = any(s.num_draft_tokens for s in plan.scheduled)
        now[0] += (0.005 if drafted else 0.0) + 0.001  # the round trip, then the step
        sched.update(worker.step(plan))
        drafting.append(drafted)
    assert any(drafting[:50])  # tried: two sequences need no smaller batch's evidence
    assert sum(drafting[-100:]) < 15  # only the rule's occasional retries


def test_drafts_are_not_tried_at_a_batch_size_above_one_where_they_lose() -> None:
    policy = SpeculationPolicy(K)
    costly = 0.080  # a draft model that costs 80 ms a step: it loses at 8 sequences
    assert _simulate(policy, 8, 64, costly) < 0.15
    assert _simulate(policy, 16, 256, costly) == 0.0  # never tried: it lost at 8
    assert _simulate(policy, 1, 64, 0.0) > 0.8  # free drafts win at one sequence,
    assert _simulate(policy, 1, 64, costly) < 0.3  # and lose once they cost 80 ms
