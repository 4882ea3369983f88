"""The learned step cost and the prefill it leaves room for while streams decode."""

from __future__ import annotations

import pytest

from canteen.batching import BatchConfig
from canteen.plan import StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.cost import StepCostModel
from tests.unit.test_batcher import (
    BLOCK_SIZE,
    FakeWorker,
    expected_tokens,
    make_seq,
    run_until_done,
    scheduled,
    step,
)

A, B = 0.040, 0.002  # 40 ms per step plus 2 ms per token: a CPU-like worker


def seconds(num_tokens: int) -> float:
    return A + B * num_tokens


def test_the_fit_recovers_the_line_and_sizes_the_chunk() -> None:
    model = StepCostModel(max_stall=2.0, min_chunk=16)
    assert model.prefill_budget(8) == 16  # nothing known yet: small probes
    for n in [8, 8, 24, 8, 40, 8, 72, 8]:
        model.observe(n, seconds(n))
    fitted = model.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(A) and fitted[1] == pytest.approx(B)
    # 2 x (40 + 2*8) ms = 112 ms allows 36 tokens, 28 beyond the 8 decodes.
    assert model.prefill_budget(8) == 28


def test_noise_never_grants_more_than_double_the_last_budget() -> None:
    model = StepCostModel(max_stall=2.0, min_chunk=16)
    for n, t in [(8, 0.05), (400, 0.049), (8, 0.051), (300, 0.0505)]:  # flat: no slope
        model.observe(n, t)
    assert model.fit() is None and model.prefill_budget(8) == 16
    model.observe(600, 0.06)  # a barely rising line: it would allow thousands of tokens
    assert model.prefill_budget(8) == 32
    assert model.prefill_budget(8) == 64


def test_steps_of_one_size_never_claim_a_slope() -> None:
    model = StepCostModel(max_stall=3.0, min_chunk=4)
    for _ in range(50):
        model.observe(8, 0.05)
    assert model.fit() is None and model.prefill_budget(8) == 4


def test_a_bad_stall_bound_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_stall=0.5: must be >= 1"):
        StepCostModel(0.5, 16)


class TimedWorker(FakeWorker):
    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        return StepResult(
            result.step_id,
            result.tokens,
            result.num_tokens,
            total_ns=int(seconds(plan.num_tokens) * 1e9),
        )


def _stalled(max_batched_tokens: int, max_num_seqs: int) -> tuple[BatchScheduler, TimedWorker]:
    """A batcher with a 2x stall bound and 8-token chunks, one plan at a time, and a
    worker whose steps take ``seconds(tokens)``."""
    limits = BatchConfig(
        max_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_step_stall=2.0,
        min_prefill_chunk=8,
        pipeline_depth=1,
    )
    return BatchScheduler(BlockPool(400, BLOCK_SIZE), limits), TimedWorker(400)


def test_a_long_prompt_never_stretches_a_decode_step_past_the_bound() -> None:
    sched, worker = _stalled(512, 16)
    streams = [make_seq(f"s{i}", prompt_len=4, max_tokens=200) for i in range(8)]
    for s in streams:
        sched.add(s)
    for _ in range(5):
        step(sched, worker)
    long = make_seq("long", prompt_len=600, max_tokens=4)
    sched.add(long)
    decode_only = seconds(8)
    worst = 0.0
    while long.num_computed < 600:
        plan = sched.schedule()
        assert plan is not None and all(scheduled(plan)[s.request_id] == 1 for s in streams)
        worst = max(worst, seconds(plan.num_tokens) / decode_only)
        sched.update(worker.step(plan))
    # Probing chunks first, then chunks sized from the learned line: never above 2x.
    assert worst <= 2.0 + 1e-9
    assert len(worker.plans) < 5 + 600 // 8  # it did learn: chunks grew past the probe size
    run_until_done(sched, worker)
    assert long.output_ids == expected_tokens(long.prompt_ids, 4)
    assert streams[0].output_ids == expected_tokens(streams[0].prompt_ids, 200)


def test_more_waiting_than_decoding_streams_stretches_the_bound_by_their_ratio() -> None:
    model = StepCostModel(max_stall=2.0, min_chunk=16)
    for n in [8, 8, 24, 8, 40, 8, 72, 8]:
        model.observe(n, seconds(n))
    assert model.prefill_budget(8, num_waiting=4) == 28  # fewer waiting: the plain bound
    # One stream decoding, 15 waiting: 2 x 15 x (40 + 2) ms = 1,260 ms allows 610 tokens.
    assert model.prefill_budget(1, num_waiting=15) == 609
    # The next step with one waiting stream is back to the plain bound, not 15x of it:
    # 2 x 42 ms = 84 ms allows 22 tokens, 21 beyond the decode.
    assert model.prefill_budget(1, num_waiting=1) == 21


def test_a_burst_next_to_one_running_stream_is_prefilled_in_one_step() -> None:
    sched, worker = _stalled(1024, 32)
    first = make_seq("first", prompt_len=64, max_tokens=100)
    sched.add(first)
    for _ in range(6):
        step(sched, worker)
    burst = [make_seq(f"b{i}", prompt_len=40, max_tokens=8) for i in range(15)]
    for s in burst:
        sched.add(s)
    plan = sched.schedule()
    assert plan is not None
    # Every prompt of the burst, whole, next to the running stream's decode.
    assert scheduled(plan) == {"first": 1, **{s.request_id: 40 for s in burst}}
    sched.update(worker.step(plan))
    run_until_done(sched, worker)
    assert [s.output_ids for s in burst] == [expected_tokens(s.prompt_ids, 8) for s in burst]


def test_the_stretch_counts_only_the_streams_the_bound_protects() -> None:
    model = StepCostModel(max_stall=2.0, min_chunk=16)
    for n in [8, 8, 24, 8, 40, 8, 72, 8]:
        model.observe(n, seconds(n))
    assert model.prefill_budget(8, num_waiting=4) == 28  # 4 waiting, 8 protected: plain
    # 8 decoding, one of them protected: 2 x 4 x (40 + 2*8) ms = 448 ms allows 204 tokens,
    # 196 beyond the decodes.
    assert model.prefill_budget(8, num_waiting=4, num_protected=1) == 196


def test_a_burst_is_not_prefilled_a_chunk_a_step_behind_its_own_first_part() -> None:
    """A burst larger than one step's token budget: the part admitted first has no claim
    to be spared the rest's prefill, so the next step fills its whole budget with it."""
    sched, worker = _stalled(256, 32)
    warm = make_seq("warm", prompt_len=64, max_tokens=6)  # teaches the cost model its line
    sched.add(warm)
    run_until_done(sched, worker)
    assert sched.cost is not None and sched.cost.fit() is not None
    burst = [make_seq(f"b{i}", prompt_len=40, max_tokens=8) for i in range(15)]
    for s in burst:
        sched.add(s)
    first = sched.schedule()
    assert first is not None and first.num_tokens == 256  # 6 prompts and 16 of a 7th
    sched.update(worker.step(first))
    second = sched.schedule()
    assert second is not None
    # 6 decodes, and the whole rest of the budget for the burst's prefill (the protected
    # rule would have allowed 2 x 1.5 x (40 + 2*6) ms = 156 ms: 52 tokens).
    assert second.num_tokens == 256
    assert sum(n for n in scheduled(second).values() if n == 1) == 6
    sched.update(worker.step(second))
    run_until_done(sched, worker)
    assert [s.output_ids for s in burst] == [expected_tokens(s.prompt_ids, 8) for s in burst]


def test_streams_that_streamed_before_a_prompt_arrived_keep_the_bound() -> None:
    """The same burst next to streams already streaming: the bound holds for their sake,
    stretched by waiting over protected streams."""
    sched, worker = _stalled(256, 32)
    streams = [make_seq(f"s{i}", prompt_len=8, max_tokens=200) for i in range(12)]
    for s in streams:
        sched.add(s)
    for _ in range(4):
        step(sched, worker)
    long = make_seq("long", prompt_len=120, max_tokens=4)
    sched.add(long)
    decode_only = seconds(12)
    for _ in range(3):
        plan = sched.schedule()
        assert plan is not None and all(scheduled(plan)[s.request_id] == 1 for s in streams)
        # one waiting against 12 protected: the plain bound, 2x a decode-only step
        assert seconds(plan.num_tokens) <= 2.0 * decode_only + 1e-9
        sched.update(worker.step(plan))
