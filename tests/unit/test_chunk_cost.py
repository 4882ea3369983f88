"""Chunk sizes from a step cost with a key term: a prompt's late chunks read every key
before them, so the stall bound sizes them by position (scheduler/cost.py)."""

from __future__ import annotations

import pytest

from canteen.batching import BatchConfig
from canteen.plan import StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.cost import StepCostModel, chunk_keys, largest_chunk
from tests.unit.test_batcher import (
    BLOCK_SIZE,
    FakeWorker,
    expected_tokens,
    make_seq,
    run_until_done,
    scheduled,
    step,
)

A, B, C = 0.040, 0.002, 1e-6  # 40 ms a step, 2 ms a token, 1 us a key read


def seconds(num_tokens: int, num_keys: int) -> float:
    return A + B * num_tokens + C * num_keys


def taught() -> StepCostModel:
    """A model that saw decode-only steps (8 rows over ~100 keys each) and steps that also
    carried chunks at several positions."""
    model = StepCostModel(max_stall=2.0, min_chunk=16)
    for n, k in [(8, 800), (24, 1500), (8, 820), (40, 9000), (8, 840), (24, 30000), (72, 4000)]:
        model.observe(n, seconds(n, k), k)
    return model


def test_the_fit_recovers_the_key_term() -> None:
    fitted = taught().fit_keys()
    assert fitted is not None
    assert fitted == pytest.approx((A, B, C), rel=1e-6)


def test_a_late_chunk_is_smaller_than_an_early_one() -> None:
    model = taught()
    # 8 decodes over 800 keys: 40 + 16 + 0.8 = 56.8 ms, so a chunk may add 56.8 ms.
    # At position 0, 28 tokens: 56 ms + 406 keys (0.406 ms) = 56.406 ms; 29 would be 58.4.
    assert model.prefill_budget(8, position=0, decode_keys=800) == 28
    # After 1,900 tokens, each token also reads ~1,900 keys: 14 tokens cost 28 ms + 26,705
    # keys (26.7 ms) = 54.7 ms; 15 would cost 58.6 ms.
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 14


def test_the_floor_is_the_cost_of_min_chunk_fresh_tokens() -> None:
    model = StepCostModel(max_stall=1.0, min_chunk=16)  # no room beyond the decodes at all
    for n, k in [(8, 800), (24, 1500), (8, 820), (40, 9000), (8, 840), (24, 30000), (72, 4000)]:
        model.observe(n, seconds(n, k), k)
    # 16 fresh tokens: 32 ms + 136 keys = 32.136 ms, the time any step may add.
    assert model.prefill_budget(8, position=0, decode_keys=800) == 16
    # After 1,900 tokens that buys 8: 16 ms + 15,236 keys = 31.236 ms; 9 would be 35.2 ms.
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 8
    # However late, a prompt progresses by a token a step.
    assert largest_chunk(0.0, B, C, 10**6) == 1


def test_keys_that_move_with_the_tokens_leave_the_plain_line() -> None:
    model = StepCostModel(max_stall=2.0, min_chunk=16)
    for n in [8, 8, 24, 8, 40, 8, 72, 8]:
        model.observe(n, seconds(n, 100 * n), 100 * n)  # k = 100 n: not separable
    assert model.fit_keys() is None
    # the line t = 40 ms + 2.1 ms n: 2 x (40 + 16.8) ms allows 35 tokens, 27 beyond 8.
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 27


class KeyTimedWorker(FakeWorker):
    """Steps take ``seconds(tokens, keys)``, the keys counted from each sequence's position."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.done: dict[str, int] = {}
        self.costs: list[float] = []

    def step(self, plan: StepPlan) -> StepResult:
        keys = 0
        for s in plan.scheduled:
            keys += chunk_keys(s.num_tokens, self.done.get(s.seq_id, 0))
            self.done[s.seq_id] = self.done.get(s.seq_id, 0) + s.num_tokens
        self.costs.append(seconds(plan.num_tokens, keys))
        result = super().step(plan)
        return StepResult(
            result.step_id, result.tokens, result.num_tokens, total_ns=int(self.costs[-1] * 1e9)
        )


def test_a_long_prompt_keeps_late_steps_within_the_bound() -> None:
    """With 20 us a key, a chunk of the 8-token minimum after 600 tokens would take 2.3x a
    decode-only step; the batcher learns the key term and shrinks late chunks below it."""
    global C
    limits = BatchConfig(
        max_batched_tokens=512,
        max_num_seqs=16,
        max_step_stall=2.0,
        min_prefill_chunk=8,
        pipeline_depth=1,
    )
    sched, worker = BatchScheduler(BlockPool(400, BLOCK_SIZE), limits), KeyTimedWorker(400)
    saved, C = C, 20e-6
    try:
        streams = [make_seq(f"s{i}", prompt_len=4, max_tokens=200) for i in range(8)]
        for s in streams:
            sched.add(s)
        for _ in range(5):
            step(sched, worker)
        long = make_seq("long", prompt_len=600, max_tokens=4)
        sched.add(long)
        chunks: list[int] = []
        while long.num_computed < 600:
            plan = sched.schedule()
            assert plan is not None and all(scheduled(plan)[s.request_id] == 1 for s in streams)
            chunks.append(scheduled(plan).get("long", 0))
            sched.update(worker.step(plan))
        decode_only = seconds(8, 8 * (5 + len(chunks) + 4))
        assert max(worker.costs[5:]) <= 2.0 * decode_only
        assert min(chunks[-5:]) < 8  # late chunks below the minimum, sized by the keys
        run_until_done(sched, worker)
    finally:
        C = saved
    assert long.output_ids == expected_tokens(long.prompt_ids, 4)
    assert streams[0].output_ids == expected_tokens(streams[0].prompt_ids, 200)
