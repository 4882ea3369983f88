"""Speculative decoding on the worker: the n-gram proposer, and verification with n-gram
drafts and with a draft model on the tiny model (greedy equals transformers, seeded sampling
equals the run without drafts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan, StepResult
from tests.support import reference
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model
from worker.speculation.draft import can_share_kv
from worker.speculation.speculate import SpeculationConfig, accept, propose_ngram

K = 4


def test_ngram_proposals_follow_the_latest_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 3, max_n=3, min_n=2) == [7, 8, 1]
    assert propose_ngram([5, 6, 7, 8], 3) == []
    assert propose_ngram(tokens, 0) == []
    assert accept([7, 8, 1], [7, 8, 5, 9]) == [7, 8, 5]
    assert accept([7, 8], [7, 8, 6]) == [7, 8, 6]
    assert accept([7, 8], [3, 8, 6]) == [3]


# -- the worker's verification, on the tiny model ------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(
        str(tiny_model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
    )


def _decode(runner: ModelRunner, prompt: list[int], sampling: Sampling, new: int) -> list[int]:
    """One sequence to ``new`` tokens, granting drafts every step (as the scheduler would)."""
    runner.reset()
    blocks = tuple(range(runner.blocks_for(len(prompt) + new + K + 1)))
    seq = NewSequence("s", tuple(prompt), sampling, blocks)
    plan = StepPlan(0, (seq,), (ScheduledSequence("s", len(prompt), (), K),))
    out: list[int] = []
    step = 0
    while len(out) < new:
        result = runner.step(plan)
        assert not result.failed
        out += [t.token_id for t in result.tokens]
        step += 1
        plan = StepPlan(step, (), (ScheduledSequence("s", 1, (), K),))
    return out[:new]


def _record_steps(runner: ModelRunner) -> list[StepResult]:
    """The results of every step ``runner`` runs from now on, in order."""
    steps: list[StepResult] = []
    original = runner.step

    def recording(plan: StepPlan) -> StepResult:
        steps.append(original(plan))
        return steps[-1]

    runner.step = recording  # type: ignore[method-assign]
    return steps


def test_greedy_with_drafts_equals_transformers_and_drafts_are_accepted(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    tok = reference.tokenizer(tiny_model_dir)
    text = "The capital of France is Paris. The capital of Italy is Rome. " * 3
    prompt = list(tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    plain = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    drafting = ModelRunner(loaded, RunnerConfig(64, 8, 256, SpeculationConfig("ngram", K)))
    expected = reference.greedy(tiny_model_dir, prompt, 40)
    assert _decode(plain, prompt, Sampling(0.0), 40) == expected
    steps = _record_steps(drafting)
    assert _decode(drafting, prompt, Sampling(0.0), 40) == expected
    assert sum(s.num_draft_tokens for s in steps) > 0
    assert sum(s.num_accepted_tokens for s in steps) > 0
    # every step granted drafts says how many it proposed, 0 where the n-gram found none
    assert all(set(s.num_proposed) == {"s"} for s in steps[1:])
    assert [s.num_proposed["s"] for s in steps[1:]] == [s.num_draft_tokens for s in steps[1:]]
    assert any(s.num_proposed["s"] == 0 for s in steps[1:])


def test_seeded_sampling_with_drafts_makes_the_same_tokens(loaded: LoadedModel) -> None:
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]
    sampling = Sampling(temperature=0.8, top_p=0.95, seed=1234)
    plain_runner = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    plain_steps = _record_steps(plain_runner)
    plain = _decode(plain_runner, prompt, sampling, 40)
    drafting = ModelRunner(loaded, RunnerConfig(64, 8, 256, SpeculationConfig("ngram", K)))
    steps = _record_steps(drafting)
    assert _decode(drafting, prompt, sampling, 40) == plain
    # drafts were verified, and some held, on one side only (both were granted K each step)
    assert sum(s.num_accepted_tokens for s in steps) > 0
    assert sum(s.num_draft_tokens for s in plain_steps) == 0


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A different random model with the same tokenizer: its drafts mostly miss."""
    from tests.support.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("other"), seed=1, hidden_size=32)
    return load_model(str(path), "safetensors", "", torch.device("cpu"), torch.float32, False)


@pytest.mark.parametrize("which", ["same", "shared", "other"])
def test_a_draft_model_changes_no_token(
    loaded: LoadedModel, other: LoadedModel, tiny_model_dir: Path, which: str
) -> None:
    """The same model as its own draft, with a pool of its own or reading the target's
    (every draft holds either way), and a different one (most miss): greedy equals
    transformers, seeded sampling equals the run without drafts."""
    draft = other if which == "other" else loaded
    spec = SpeculationConfig("draft", K)
    prompt = [7, 8, 9, 10, 11, 3, 5, 8, 13, 21]
    runner = ModelRunner(
        loaded, RunnerConfig(64, 8, 256, spec, draft_shares_kv=which == "shared"), draft
    )
    assert runner.draft is not None
    assert (runner.draft.kv_pool is runner.kv_pool) == (which == "shared")
    steps = _record_steps(runner)
    assert _decode(runner, prompt, Sampling(0.0), 40) == reference.greedy(
        tiny_model_dir, prompt, 40
    )
    drafts = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    assert drafts > 0
    if which != "other":
        assert accepted == drafts and len(steps) <= 40 // (K + 1) + 2
    sampling = Sampling(temperature=0.8, seed=77)
    plain = _decode(ModelRunner(loaded, RunnerConfig(64, 8, 256)), prompt, sampling, 40)
    assert _decode(runner, prompt, sampling, 40) == plain


def test_worker_flags_name_what_is_wrong() -> None:
    from worker.config import WorkerConfig

    with pytest.raises(ValueError, match="speculative"):
        WorkerConfig(speculative="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        WorkerConfig(speculative="draft")
    with pytest.raises(ValueError, match="draft_model"):
        WorkerConfig(speculative="ngram", draft_model="tiny")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        WorkerConfig(speculative="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="dtype"):
        WorkerConfig(
            speculative="draft", draft_model="tiny", draft_quantization="int4", dtype="float32"
        )
    assert WorkerConfig(speculative="draft", draft_model="m:v1").draft_model == "m:v1"


def test_only_a_draft_of_the_same_weights_and_layout_reads_the_targets_pool(
    loaded: LoadedModel, other: LoadedModel
) -> None:
    assert can_share_kv(loaded, loaded, same_weights=True)
    assert not can_share_kv(loaded, loaded, same_weights=False)
    assert not can_share_kv(loaded, other, same_weights=True)  # another KV layout
    with pytest.raises(ValueError, match="only a draft with the target's KV layout"):
        ModelRunner(
            loaded,
            RunnerConfig(64, 8, 256, SpeculationConfig("draft", K), draft_shares_kv=True),
            other,
        )
