"""The worker's constrained sampling on the tiny model, in process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from canteen.plan import Constraint, NewSequence, Sampling, ScheduledSequence, StepPlan
from tests.support import reference
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model

REGEX = Constraint("regex", r"[a-z]{4}( [a-z]{2,6}){6}\.")
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(
        str(tiny_model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
    )


def _run(
    runner: ModelRunner,
    seqs: dict[str, tuple[list[int], Sampling, int]],
    count: int,
) -> dict[str, list[int]]:
    """Runs (tokens, sampling, num_prompt_tokens) sequences until each has made ``count``
    tokens. A step may defer a constrained row while its grammar compiles (a cached grammar
    does not), so the step count that makes ``count`` tokens depends on timing; the tokens
    do not."""
    per = 12
    news = tuple(
        NewSequence(s, tuple(t), sampling, tuple(range(i * per, (i + 1) * per)), 0, "", "", n)
        for i, (s, (t, sampling, n)) in enumerate(seqs.items())
    )
    plan = StepPlan(0, news, tuple(ScheduledSequence(n.seq_id, len(n.token_ids)) for n in news))
    out: dict[str, list[int]] = {s: [] for s in seqs}
    step = 0
    while any(len(made) < count for made in out.values()):
        assert step < count + 1000, f"{count} tokens not made in {step} steps: {out}"
        result = runner.step(plan)
        assert not result.failed, result.failed
        for token in result.tokens:
            out[token.seq_id].append(token.token_id)
        # as the scheduler plans it: the tokens not yet computed (more than one only after a
        # step that deferred the sequence while its grammar compiled)
        live = [runner.sequences[s] for s in seqs if s in runner.sequences]
        plan = StepPlan(
            step + 1,
            (),
            tuple(ScheduledSequence(q.seq_id, len(q.tokens) - q.num_computed) for q in live),
        )
        step += 1
    return {s: made[:count] for s, made in out.items()}


def test_a_constrained_row_matches_and_free_rows_stay_exact(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    free = [3, 1, 4, 1, 5, 9, 2, 6]
    out = _run(
        runner,
        {
            "shaped": (PROMPT, Sampling(temperature=1.0, seed=4, constraint=REGEX), len(PROMPT)),
            "free": (free, Sampling(0.0), len(free)),
        },
        40,
    )
    assert out["free"] == reference.greedy(tiny_model_dir, free, 40)
    text = reference.tokenizer(tiny_model_dir).decode(out["shaped"])  # type: ignore[attr-defined]
    eos = loaded.eos_token_ids[0]
    assert eos in out["shaped"], text  # complete: only end-of-sequence was left
    done = out["shaped"].index(eos)
    complete = reference.tokenizer(tiny_model_dir).decode(out["shaped"][:done])  # type: ignore[attr-defined]
    assert re.fullmatch(REGEX.text, complete), complete


def test_a_resumed_sequence_replays_its_tokens_and_continues_exactly(loaded: LoadedModel) -> None:
    sampling = Sampling(temperature=1.0, seed=9, constraint=REGEX)
    whole = _run(
        ModelRunner(loaded, RunnerConfig(64, 8, 256)), {"s": (PROMPT, sampling, len(PROMPT))}, 16
    )["s"]
    first = whole[:6]
    # A new worker gets the prompt plus the six tokens made before the move.
    rest = _run(
        ModelRunner(loaded, RunnerConfig(64, 8, 256)),
        {"s": (PROMPT + first, sampling, len(PROMPT))},
        10,
    )["s"]
    assert first + rest == whole


def test_generated_tokens_the_grammar_refuses_fail_only_that_sequence(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    bad = NewSequence(
        "bad", (*PROMPT, 2, 2, 2), Sampling(0.0, constraint=REGEX), tuple(range(12)),
        num_prompt_tokens=len(PROMPT),
    )  # fmt: skip
    good = NewSequence("good", tuple(PROMPT), Sampling(0.0), tuple(range(12, 24)))
    plan = StepPlan(
        0, (bad, good), (ScheduledSequence("bad", 8), ScheduledSequence("good", len(PROMPT)))
    )
    result = runner.step(plan)
    while result.deferred_seq_ids == ("bad",):  # its replay still compiling: planned again
        assert [t.seq_id for t in result.tokens] == (["good"] if plan.step_id == 0 else [])
        # as the scheduler plans it: a deferred row kept its step's KV but its last token
        q = runner.sequences["bad"]
        plan = StepPlan(
            plan.step_id + 1, (), (ScheduledSequence("bad", len(q.tokens) - q.num_computed),)
        )
        result = runner.step(plan)
    assert [f.seq_id for f in result.failed] == ["bad"]
    assert "does not fit its regex" in result.failed[0].error
    assert [t.seq_id for t in result.tokens] == (["good"] if plan.step_id == 0 else [])
    # its blocks were never taken: another sequence may have them at once
    again = NewSequence("again", tuple(PROMPT), Sampling(0.0), tuple(range(12)))
    result = runner.step(
        StepPlan(plan.step_id + 1, (again,), (ScheduledSequence("again", len(PROMPT)),))
    )
    assert not result.failed and [t.seq_id for t in result.tokens] == ["again"]
