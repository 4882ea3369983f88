"""The learned speculation rule (scheduler/speculation.py) against one slow drafting step."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from canteen.batching import BatchConfig
from canteen.plan import StepPlan
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.speculation import EXPLORE_EVERY, DraftRecord, SpeculationPolicy
from tests.unit.test_batcher import BLOCK_SIZE, expected_tokens, make_seq
from tests.unit.test_speculation import DraftingWorker

K = 4


def _run(policy: SpeculationPolicy, record: DraftRecord, steps: int, *slow: float) -> int:
    """One stream whose drafts all hold; plain steps take 35 ms, drafting ones 45 ms except
    the first measured ones, which take ``slow``. Returns the drafting steps."""
    drafting, last, left = 0, None, list(slow)
    for _ in range(steps):
        on = policy.drafts_for(1, [record]) > 0
        seconds = 0.035
        if on:
            drafting += 1
            record.observe(K)
            switched = last is not None and last != on
            seconds = left.pop(0) if left and not switched else 0.045
        policy.observe(1, on, seconds, K if on else 0, K if on else 0)
        last = on
    return drafting


def test_one_slow_drafting_step_does_not_keep_a_stream_from_drafting() -> None:
    """The first measured drafting step took 220 ms against 35 ms plain ones (seen in the
    e2e suite: a break-even of 5.2 accepted drafts, more than the 4 a step can hold). The
    rule tries again and, the next drafting steps taking 45 ms, drafts for most of the
    stream; the rule without MIN_MEASURED never drafted again."""
    policy = SpeculationPolicy(K)
    assert _run(policy, DraftRecord(), 200, 0.220) > 150


def test_three_slow_first_drafting_steps_do_not_keep_a_stream_from_drafting() -> None:
    """The first three measured drafting steps slow (a busy host while the suite warms up:
    the e2e suite's estimate stood at 197 ms against 35 ms plain steps): the rule judges
    "could not pay" by the quickest drafting step (100 ms: 1.9 accepted drafts would pay),
    so it keeps trying, and drafts once the 45 ms steps bring the estimate down."""
    policy = SpeculationPolicy(K)
    assert _run(policy, DraftRecord(), 400, 0.300, 0.220, 0.100) > 150


def test_drafts_that_always_cost_too_much_are_given_up_after_a_few_tries() -> None:
    """Every drafting step 220 ms: after MIN_MEASURED of them the rule stops trying."""
    policy = SpeculationPolicy(K)
    record = DraftRecord()
    drafting, last = 0, None
    for _ in range(600):
        on = policy.drafts_for(1, [record]) > 0
        drafting += on
        if on:
            record.observe(K)
        policy.observe(1, on, 0.220 if on else 0.035, K if on else 0, K if on else 0)
        last = on
    assert last is False and drafting <= 12


def _pipelined_stream(slow_steps: set[int], tokens: int = 200) -> tuple[int, int]:
    """One stream whose drafts all hold, on a scheduler that keeps two plans in flight, as
    the worker link does. A plain step takes 10 ms and a drafting one 12 ms, except the
    drafting steps whose index (counting drafting steps from 0) is in ``slow_steps``, which
    take 80 ms: a busy host. Returns the steps the stream took and the tokens drafts made."""
    now = [0.0]
    limits = BatchConfig(max_batched_tokens=64, max_num_seqs=16, max_step_stall=0, pipeline_depth=2)
    sched = BatchScheduler(
        BlockPool(256, BLOCK_SIZE), limits, num_draft_tokens=K, clock=lambda: now[0]
    )
    worker = DraftingWorker(256)
    seq = make_seq("a", prompt_len=5, max_tokens=tokens)
    sched.add(seq)
    in_flight: deque[StepPlan] = deque()
    drafting = 0
    while not seq.is_finished:
        while (plan := sched.schedule()) is not None:
            in_flight.append(plan)
        plan = in_flight.popleft()
        seconds = 0.010
        if any(s.num_draft_tokens for s in plan.scheduled):
            seconds = 0.080 if drafting in slow_steps else 0.012
            drafting += 1
        now[0] += seconds
        result = replace(worker.step(plan), total_ns=int(seconds * 1e9))
        sched.update(result)
    assert seq.output_ids == expected_tokens(seq.prompt_ids, tokens)
    return len(worker.plans), sched.speculation.num_accepted_tokens


def test_a_slow_drafting_step_on_a_busy_host_costs_a_stream_few_drafts() -> None:
    """CI once measured a stream's first drafting steps at several plain ones: the rule then
    kept a paragraph-repeating answer to 12 accepted drafts in 64 tokens. Its moving average
    let one slow step outweigh the normal ones after it, and each try was judged before its
    own measured step came back, so every try "lost" on the old figure and the next came
    twice as late. Judged by the quickest recent step, once its try is measured, the stream
    drafts again at once after a slow step among normal ones, and after one try (some
    EXPLORE_EVERY steps) where its only measured drafting steps were slow."""
    steps, accepted = _pipelined_stream(set())
    assert accepted >= 150  # no slow step: most tokens come from drafts
    for slow in ({1}, {1, 3}):  # drafting step 0 is the switch, never measured
        assert _pipelined_stream(slow)[0] <= steps + 3, slow  # before: 94 steps for {1, 3}
    slowed_steps, slowed_accepted = _pipelined_stream({1, 2})
    assert slowed_steps <= steps + EXPLORE_EVERY + 10  # before: 94
    assert slowed_accepted >= accepted - EXPLORE_EVERY - 10
