"""Chunk sizes from a step cost with a key term: a prompt's late chunks read every key
before them, so the stall bound sizes them by position (scheduler/cost.py)."""

from __future__ import annotations

import math
import random

import pytest

from canteen.batching import DEFAULT, BatchConfig
from canteen.plan import StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.cost import (
    DECODE_WINDOW,
    UNBOUNDED,
    StepCostModel,
    chunk_keys,
    largest_chunk,
)
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


def taught_at(max_stall: float) -> StepCostModel:
    model = StepCostModel(max_stall=max_stall, min_chunk=16)
    for n, k in [(8, 800), (24, 1500), (8, 820), (40, 9000), (8, 840), (24, 30000), (72, 4000)]:
        model.observe(n, seconds(n, k), k)
    return model


def test_the_default_bound_sizes_chunks_by_position() -> None:
    model = taught_at(1.5)  # the shipped --max-step-stall
    # 8 decodes over 800 keys take 56.8 ms, so a chunk may add half of that: 28.4 ms.
    # At position 0, 14 tokens: 28 ms + 105 keys = 28.105 ms; 15 would be 30.12 ms.
    assert model.prefill_budget(8, position=0, decode_keys=800) == 14
    # After 1,900 tokens, 7: 14 ms + 13,328 keys = 27.3 ms; 8 would be 31.2 ms. Fewer than
    # min_chunk (16): its 16 fresh tokens alone (32.1 ms) would break the bound.
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 7


def test_once_the_cost_is_known_the_floor_is_one_token() -> None:
    model = taught_at(1.0)  # no room beyond the decodes at all
    assert model.prefill_budget(8, position=0, decode_keys=800) == 1
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 1
    # However late, a prompt progresses by a token a step.
    assert largest_chunk(0.0, B, C, 10**6) == 1


def test_one_step_slowed_by_the_host_is_not_learned() -> None:
    model = taught_at(1.5)
    fitted = model.fit_keys()
    model.observe(8, 10 * seconds(8, 800), 800)  # another process took the cores
    assert model.fit_keys() == fitted
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 7
    # Three in a row: the machine is slower now, and the model follows it.
    model.observe(8, 10 * seconds(8, 800), 800)
    model.observe(8, 10 * seconds(8, 800), 800)
    assert model.fit_keys() != fitted


def test_decode_only_steps_do_not_forget_the_learned_slopes() -> None:
    """A long stretch of decode-only steps leaves no spread to fit a slope to; the next
    prompt is still sized by the slopes learned before, not probed at min_chunk again."""
    model = taught_at(1.5)
    for _ in range(200):
        model.observe(8, seconds(8, 800), 800)
    assert model.fit_keys() is None and model.fit() is None
    assert model.estimate(8, 800) == pytest.approx(seconds(8, 800))
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 7


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


def test_jitter_is_not_taken_for_a_key_term() -> None:
    """Steps whose time has no key term but 20% jitter (a tiny model, a busy host): the
    key term is within its standard error of zero, so the plain line sizes late chunks
    instead of a spurious cost per key holding them to a token a step."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    jitter = random.Random(7)
    for i in range(60):
        n, k = (24, 800 + 400 * i) if i % 2 else (8, 800 + 8 * i)
        model.observe(n, (A + B * n) * jitter.uniform(0.8, 1.2), k)
    assert model.fit_keys() is None
    line = model.fit()
    assert line is not None
    a, b = line
    plain = int((1.5 * (a + 8 * b) - a) / b) - 8
    assert plain >= 8
    assert model.prefill_budget(8, position=1900, decode_keys=800) == min(plain, 32)


J = 0.008  # what a step costs more for carrying any chunk at all (a kernel tile, a group)
JUMP_STEPS = [
    (8, 800, False),
    (8, 810, False),
    (8, 815, False),
    (24, 1500, True),
    (8, 820, False),
    (40, 9000, True),
    (8, 840, False),
    (24, 30000, True),
    (72, 4000, True),
    (16, 20000, True),
    (12, 600, True),
]


def with_jump(num_tokens: int, num_keys: int, has_chunk: bool) -> float:
    return seconds(num_tokens, num_keys) + (J if has_chunk else 0.0)


def taught_with_jump(is_told: bool) -> StepCostModel:
    """The default bound, taught steps whose chunks cost J on top of the line; ``is_told``:
    each step says whether it was decode-only, as the batcher's do."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    for n, k, has_chunk in JUMP_STEPS:
        model.observe(n, with_jump(n, k, has_chunk), k, (not has_chunk) if is_told else None)
    return model


def test_a_chunk_steps_fixed_cost_is_kept_within_the_bound() -> None:
    decode = with_jump(8, 800, False)  # 56.8 ms
    # Told apart, chunk steps ran 5.4 ms over the line on average: the chunks shrink so
    # that the step, fixed cost included, stays under 1.5 x the decode step.
    told = taught_with_jump(is_told=True)
    assert told.chunk_excess() == pytest.approx(0.005355, abs=1e-6)
    assert told.prefill_budget(8, position=0, decode_keys=800) == 9
    assert told.prefill_budget(8, position=1900, decode_keys=800) == 4
    assert with_jump(8 + 9, 800 + chunk_keys(9, 0), True) / decode == pytest.approx(1.4585, 1e-4)
    assert with_jump(12, 800 + chunk_keys(4, 1900), True) / decode == pytest.approx(1.4157, 1e-4)
    # Not told (the line alone): 13 and 6 tokens, steps 1.60x and 1.55x the decode step.
    blind = taught_with_jump(is_told=False)
    assert blind.prefill_budget(8, position=0, decode_keys=800) == 13
    assert blind.prefill_budget(8, position=1900, decode_keys=800) == 6
    assert with_jump(21, 800 + chunk_keys(13, 0), True) / decode == pytest.approx(1.6002, 1e-4)


def slower_line_faster_decodes(is_told: bool | None) -> StepCostModel:
    """The default bound's model, then five decode-only steps that ran 10% under the line."""
    model = taught_at(1.5)
    for _ in range(5):
        model.observe(8, 0.9 * seconds(8, 800), 800, is_decode_only=is_told)
    return model


def test_the_bound_is_taken_from_the_decode_steps_measured() -> None:
    told = slower_line_faster_decodes(True)
    fitted = told.fit_keys()
    assert fitted is not None
    _, b, c = fitted
    # the decode steps' mean, moved to 1,000 keys by the fitted key slope
    expected = 0.9 * seconds(8, 800) + 200 * c
    assert told.measured_decode(8, 1000, b, c) == pytest.approx(expected)
    # The line puts these decode steps at 53.2 ms, they took 51.1: the chunk may bring the
    # step to 1.5 x 51.1 ms, not 1.5 x 53.2 ms: 11 tokens at position 0 and 5 at 1,900
    # where the line alone allows 12 and 6.
    assert told.prefill_budget(8, position=0, decode_keys=800) == 11
    assert told.prefill_budget(8, position=1900, decode_keys=800) == 5
    blind = slower_line_faster_decodes(None)
    assert blind.prefill_budget(8, position=0, decode_keys=800) == 12
    assert blind.prefill_budget(8, position=1900, decode_keys=800) == 6


TAUGHT_STEPS = [(8, 800), (24, 1500), (8, 820), (40, 9000), (8, 840), (24, 30000), (72, 4000)]


def prefill_from(
    model: StepCostModel, position: int, speed: float, num_steps: int
) -> tuple[list[int], float]:
    """Chunk sizes the model gives a prompt from ``position`` on, next to 8 decodes over 800
    keys, each chunk step taking ``speed`` times ``seconds``, and the slowest step over a
    decode step at that speed."""
    sizes: list[int] = []
    worst = 0.0
    for _ in range(num_steps):
        n = model.prefill_budget(8, position=position, decode_keys=800)
        took = speed * seconds(8 + n, 800 + chunk_keys(n, position))
        model.observe(8 + n, took, 800 + chunk_keys(n, position), is_decode_only=False)
        sizes.append(n)
        worst = max(worst, took / (speed * seconds(8, 800)))
        position += n
    return sizes, worst


def test_steps_twice_as_fast_as_a_cold_fit_re_anchor_it_within_three_steps() -> None:
    """A cold worker's steps took twice their warm cost; then two warm decode-only steps,
    and the prompt's chunk steps run warm too. The third step that ran under 1 / DRIFT of
    its estimate re-anchors the fit, and chunks are what a model taught warm sizes."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    for n, k in TAUGHT_STEPS:
        model.observe(n, 2 * seconds(n, k), k, is_decode_only=n == 8)
    for _ in range(2):
        model.observe(8, seconds(8, 800), 800, is_decode_only=True)
    # (The fit before re-anchoring, with the decode steps averaged over ~30, gave 5, 5, 5,
    # 5, 4, 4: chunk steps of 1.21-1.27x where 1.5x was allowed.)
    sizes, worst = prefill_from(model, 1000, 1.0, 6)
    assert sizes == [8, 9, 9, 9, 9, 9]
    assert worst == pytest.approx(1.4831, abs=1e-4)
    assert model.num_reanchored == 1
    # the bound is held against the warm decode step: 1.5 x 56.8 ms
    assert model.prefill_budget(8, position=1053, decode_keys=800) == 9
    assert model.bound_seconds == pytest.approx(1.5 * seconds(8, 800))


def test_steps_twice_as_slow_as_the_fit_shrink_chunks_within_three_steps() -> None:
    """The machine got twice as slow in the middle of a prompt (no decode-only step since):
    after three chunk steps at twice their estimate, the fit is re-anchored and the bound
    stays held against the decode steps last measured, so chunks drop to a token."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    for n, k in TAUGHT_STEPS:
        model.observe(n, seconds(n, k), k, is_decode_only=n == 8)
    sizes, worst = prefill_from(model, 1000, 2.0, 6)
    assert sizes == [8, 8, 8, 1, 1, 1]
    assert worst < 1.5  # against a decode step as slow as the machine now is
    assert model.num_reanchored == 1


def test_a_workers_first_steps_are_not_learned() -> None:
    """The first ``warmup_steps`` (a fresh worker building its kernels' shapes, 10x slower
    here) leave no trace: the chunks are those of a model that never saw them."""
    model = StepCostModel(max_stall=1.5, min_chunk=16, warmup_steps=4)
    for n in (40, 8, 72, 8):
        model.observe(n, 10 * seconds(n, 100 * n), 100 * n)
    assert model.estimate(8, 800) is None
    for n, k in TAUGHT_STEPS:
        model.observe(n, seconds(n, k), k)
    assert model.prefill_budget(8, position=0, decode_keys=800) == 14
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 7
    with pytest.raises(ValueError, match="warmup_steps=-1: must be >= 0"):
        StepCostModel(max_stall=1.5, min_chunk=16, warmup_steps=-1)


def test_chunk_steps_that_jitter_keep_their_spread_below_the_bound() -> None:
    """Chunk steps that run 10% over and under their cost in turn (a mean the fit gets
    right, a spread it does not): once SPREAD_STEPS of them were seen, the chunks leave room
    for a standard deviation of it, and the slow half stays within the bound too."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    for n, k in TAUGHT_STEPS:
        model.observe(n, seconds(n, k), k, is_decode_only=n == 8)
    bound = 1.5 * seconds(8, 800)
    sizes, over, position = [], [], 500
    for i in range(40):
        n = model.prefill_budget(8, position=position, decode_keys=800)
        took = (1.1 if i % 2 else 0.9) * seconds(8 + n, 800 + chunk_keys(n, position))
        model.observe(8 + n, took, 800 + chunk_keys(n, position), is_decode_only=False)
        sizes.append(n)
        over.append(took / bound)
        position += n
    # before: 10 tokens, and the slow steps ran up to 6.3% over the bound
    assert sizes[:7] == [10] * 7
    assert max(over[:7]) == pytest.approx(1.0633, abs=1e-4)
    # after: 7 tokens, every step within it
    assert sizes[7:] == [7] * 33
    assert max(over[7:]) == pytest.approx(0.9862, abs=1e-4)


def test_a_step_no_stream_is_protected_from_has_no_time_bound() -> None:
    """With no stream streaming before the held prompt arrived, the step is unbounded here,
    and the time bound logged with it (bound_ms) is None, not the last step's."""
    model = taught_at(1.5)
    assert model.prefill_budget(8, position=0, decode_keys=800) == 14
    assert model.bound_seconds == pytest.approx(1.5 * seconds(8, 800))
    held = [make_seq("long", 2000, 4)]
    assert model.budget(0, [], held, tick=0) == UNBOUNDED
    assert model.bound_seconds is None


def test_a_spread_wider_than_the_room_halves_chunks_at_most() -> None:
    """Chunk steps at 160% and 40% of their cost in turn (a busy host): the spread counts
    for half the room the bound leaves, so chunks of ~10 tokens become 4-5, not 1."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    for n, k in TAUGHT_STEPS:
        model.observe(n, seconds(n, k), k, is_decode_only=n == 8)
    sizes, position = [], 500
    for i in range(40):
        n = model.prefill_budget(8, position=position, decode_keys=800)
        took = (1.6 if i % 2 else 0.4) * seconds(8 + n, 800 + chunk_keys(n, position))
        model.observe(8 + n, took, 800 + chunk_keys(n, position), is_decode_only=False)
        sizes.append(n)
        position += n
    assert sizes[:8] == [10, 10, 9, 9, 10, 9, 10, 9]
    assert sizes[8] == 6 and set(sizes[9:]) == {4, 5}


def test_every_step_with_a_chunk_carries_every_decoding_stream() -> None:
    """Pipelined (two plans in flight), as the suite runs: from the long prompt's first
    chunk to its first token, every plan holds each of the 8 streams' next token beside the
    chunk, and every result brings each stream one token, so a stream waits one step, the
    chunk's own, between two tokens, never a chunk step and then a decode step."""
    limits = BatchConfig(
        max_batched_tokens=512, max_num_seqs=16, max_step_stall=1.5, min_prefill_chunk=8
    )
    sched, worker = BatchScheduler(BlockPool(400, BLOCK_SIZE), limits), KeyTimedWorker(400)
    streams = [make_seq(f"s{i}", prompt_len=4, max_tokens=120) for i in range(8)]
    for s in streams:
        sched.add(s)
    in_flight: list[StepPlan] = []

    def pump(is_full: bool = True) -> tuple[StepPlan, StepResult]:
        while (plan := sched.schedule()) is not None:
            in_flight.append(plan)
        assert len(in_flight) == 2 or not is_full  # the worker has the next plan queued
        plan = in_flight.pop(0)
        result = worker.step(plan)
        sched.update(result)
        return plan, result

    for _ in range(6):
        pump()
    long = make_seq("long", prompt_len=300, max_tokens=4)
    sched.add(long)
    chunks: list[int] = []
    while not long.output_ids:
        plan, result = pump()
        if "long" not in scheduled(plan):
            assert not chunks  # planned before the prompt came: the plan already in flight
            continue
        chunks.append(scheduled(plan)["long"])
        assert scheduled(plan) == {**{s.seq_id: 1 for s in streams}, "long": chunks[-1]}
        made = sorted(t.seq_id for t in result.tokens if t.seq_id != "long")
        assert made == [s.seq_id for s in streams]
    assert sum(chunks) == 300 and len(chunks) >= 3  # in bounded chunks, not in one step
    while sched.has_work or in_flight:
        pump(is_full=False)
    assert long.output_ids == expected_tokens(long.prompt_ids, 4)
    assert all(s.output_ids == expected_tokens(s.prompt_ids, 120) for s in streams)


def test_the_bound_is_held_against_the_median_decode_step_not_moved_by_the_key_slope() -> None:
    """Chunk steps cost J more than the line (as taught_with_jump): the key slope fitted to
    them comes out 18% high (1.18 us a key for 1 us), so moving the decode steps to the
    streams' grown contexts by it put the bound 1.51x the decode step they take at 3,000
    keys and let a chunk of 5 run 1.47x. The median of the decode-only steps seen (the one
    at 815 keys) holds it: 4 tokens, 1.40x."""
    model = taught_with_jump(is_told=True)
    fitted = model.fit_keys()
    assert fitted is not None and fitted[2] == pytest.approx(1.1827e-6, rel=1e-4)
    assert model.median_decode(8, fitted[1]) == pytest.approx(seconds(8, 815))
    assert model.prefill_budget(8, position=1900, decode_keys=3000) == 4
    assert model.bound_seconds == pytest.approx(1.5 * seconds(8, 815))
    took = with_jump(12, 3000 + chunk_keys(4, 1900), True)
    assert took / seconds(8, 3000) == pytest.approx(1.4002, abs=1e-4)


def test_the_median_decode_step_follows_the_latest_window() -> None:
    """Only the latest DECODE_WINDOW decode-only steps count: after nine at half the time
    the bound is held against those, whatever came before; none seen: no median."""
    model = StepCostModel(max_stall=1.5, min_chunk=16)
    assert model.median_decode(8, B) == math.inf
    for n, k in TAUGHT_STEPS:
        model.observe(n, seconds(n, k), k, is_decode_only=n == 8)
    assert model.median_decode(8, B) == pytest.approx(seconds(8, 820))
    assert model.median_decode(10, B) == pytest.approx(seconds(8, 820) + 2 * B)
    for _ in range(DECODE_WINDOW):
        model.observe(8, 0.6 * seconds(8, 800), 800, is_decode_only=True)
    assert model.median_decode(8, B) == pytest.approx(0.6 * seconds(8, 800))


def test_the_shipped_bound_sizes_chunks_to_1_4x_the_decode_step() -> None:
    """The shipped --max-step-stall: a chunk step takes at most 1.4x a decode-only step of
    8 streams (56.8 ms here), so a chunk may add 22.72 ms: 11 fresh tokens (22.07 ms; 12
    would be 24.08), 5 after 1,900 (19.52 ms; 6 would be 23.42)."""
    assert DEFAULT.max_step_stall == 1.4
    model = taught_at(DEFAULT.max_step_stall)
    assert model.prefill_budget(8, position=0, decode_keys=800) == 11
    assert model.bound_seconds == pytest.approx(1.4 * seconds(8, 800))
    assert model.prefill_budget(8, position=1900, decode_keys=800) == 5
