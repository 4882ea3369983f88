"""Greedy decoding straight through a ModelRunner, for tests that compare tokens."""

from __future__ import annotations

from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from worker.engine.runner import ModelRunner


def generate(runner: ModelRunner, prompts: dict[str, list[int]], new: int) -> dict[str, list[int]]:
    """Greedy tokens for all prompts at once: one prefill step, then batched decode steps."""
    runner.reset()
    per = runner.blocks_for(max(len(p) for p in prompts.values()) + new)
    seqs = tuple(
        NewSequence(s, tuple(p), Sampling(0.0), tuple(range(i * per, (i + 1) * per)))
        for i, (s, p) in enumerate(prompts.items())
    )
    plan = StepPlan(0, seqs, tuple(ScheduledSequence(s.seq_id, len(s.token_ids)) for s in seqs))
    out: dict[str, list[int]] = {s: [] for s in prompts}
    for step in range(new):
        result = runner.step(plan)
        assert not result.failed
        for token in result.tokens:
            out[token.seq_id].append(token.token_id)
        plan = StepPlan(step + 1, (), tuple(ScheduledSequence(s, 1) for s in prompts))
    return out
