"""A sequence the worker defers (its grammar still compiling) is planned again, exactly.

The worker keeps a deferred sequence's part of a step but for its last token, and samples
nothing; the scheduler takes that entry back and plans that token again, with or without
pipelining, while the other sequences of the step go on. On the fake worker of
test_batcher.py, which checks every plan the way the real one does.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque

import pytest

from canteen.batching import BatchConfig
from canteen.finish import Finish
from canteen.plan import StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from tests.unit.test_batcher import BLOCK_SIZE, FakeWorker, expected_tokens, make_seq


class DeferringWorker(FakeWorker):
    """Defers each sequence of ``slow`` at its first ``times`` steps that would sample."""

    def __init__(self, num_blocks: int, slow: set[str], times: int) -> None:
        super().__init__(num_blocks)
        self.left = dict.fromkeys(slow, times)
        self.computed: Counter[str] = Counter()  # tokens computed, by sequence

    def step(self, plan: StepPlan) -> StepResult:
        deferred = []
        for item in plan.scheduled:
            left = self.left.get(item.seq_id, 0)
            if left and self._samples(plan, item.seq_id, item.num_tokens):
                self.left[item.seq_id] = left - 1
                deferred.append(item.seq_id)
        # a deferred sequence keeps what it computed but for its last token, sampling nothing
        kept = tuple(
            dataclasses.replace(i, num_tokens=i.num_tokens - 1) if i.seq_id in deferred else i
            for i in plan.scheduled
            if i.seq_id not in deferred or i.num_tokens > 1
        )
        self.computed.update({i.seq_id: i.num_tokens for i in kept})
        result = super().step(dataclasses.replace(plan, scheduled=kept))
        for item in plan.scheduled:  # and the blocks it was given
            if item.seq_id in deferred and item.num_tokens == 1:
                self.seqs[item.seq_id].block_ids.extend(item.new_block_ids)
        self.plans[-1] = plan
        return dataclasses.replace(result, deferred_seq_ids=tuple(deferred))

    def _samples(self, plan: StepPlan, seq_id: str, num_tokens: int) -> bool:
        new = {n.seq_id: n for n in plan.new_sequences}
        if seq_id in new:
            return new[seq_id].num_cached_tokens + num_tokens == len(new[seq_id].token_ids)
        seq = self.seqs[seq_id]
        return seq.num_computed + num_tokens == len(seq.tokens)


def _scheduler(depth: int) -> BatchScheduler:
    limits = BatchConfig(
        max_batched_tokens=64, max_num_seqs=16, max_step_stall=0, pipeline_depth=depth
    )
    return BatchScheduler(BlockPool(64, BLOCK_SIZE), limits)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("max_tokens", [1, 2, 6])
def test_a_deferred_sequence_gets_its_exact_tokens_and_the_other_one_is_not_held(
    depth: int, max_tokens: int
) -> None:
    sched = _scheduler(depth)
    worker = DeferringWorker(64, {"slow"}, times=3)
    slow = make_seq("slow", prompt_len=7, max_tokens=max_tokens)
    free = make_seq("free", prompt_len=5, max_tokens=6)
    sched.add(slow)
    sched.add(free)
    sent: deque[StepPlan] = deque()
    free_steps = []  # the step (results applied) at which each of free's tokens arrived
    num_results = 0
    while sched.has_work or sent:
        while (plan := sched.schedule()) is not None:
            sent.append(plan)
        if not sent:
            break
        before = len(free.output_ids)
        sched.update(worker.step(sent.popleft()))
        num_results += 1
        free_steps += [num_results] * (len(free.output_ids) - before)
        assert num_results < 200
    assert slow.finish is Finish.LENGTH and free.finish is Finish.LENGTH
    assert slow.output_ids == expected_tokens(slow.prompt_ids, max_tokens)
    assert free.output_ids == expected_tokens(free.prompt_ids, 6)
    # the free sequence made a token at each of its steps, deferrals or not
    assert free_steps == list(range(free_steps[0], free_steps[0] + 6))
    assert worker.left == {"slow": 0}  # deferred three times
    if max_tokens > depth:  # (a plan sampling the last token dropped it early: starts over)
        # each token computed once: a deferral keeps the prompt but its last token, which
        # is planned again alone (a second deferral of that one token keeps nothing)
        assert worker.computed["slow"] == 7 + max_tokens - 1
    assert sched.pool.num_free == 64 and worker.seqs == {}
