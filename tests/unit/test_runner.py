"""The worker's runner on the tiny model, in process: bounded buffers, same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from tests.support import reference
from worker.attention.batch import group_decodes
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model

BLOCK = 8


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(
        str(tiny_model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
    )


def _generate(
    runner: ModelRunner, prompts: dict[str, list[int]], max_new: int, chunk: int
) -> dict[str, list[int]]:
    """Greedy tokens for every prompt at once: chunked prefill, then batched decode."""
    next_block = 0
    new = []
    for seq_id, ids in prompts.items():
        n = runner.blocks_for(len(ids) + max_new)
        new.append(
            NewSequence(seq_id, tuple(ids), Sampling(0.0), tuple(range(next_block, next_block + n)))
        )
        next_block += n
    out: dict[str, list[int]] = {seq_id: [] for seq_id in prompts}
    left = {seq_id: len(ids) for seq_id, ids in prompts.items()}
    step = 0
    while any(len(o) < max_new for o in out.values()):
        scheduled = []
        for seq_id in prompts:
            if len(out[seq_id]) < max_new:
                n = min(left[seq_id], chunk) if left[seq_id] else 1
                left[seq_id] -= min(left[seq_id], chunk)
                scheduled.append(ScheduledSequence(seq_id, n))
        result = runner.step(StepPlan(step, tuple(new) if step == 0 else (), tuple(scheduled)))
        for token in result.tokens:
            out[token.seq_id].append(token.token_id)
        step += 1
    return out


def test_long_prefill_in_query_slices_matches_transformers(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    # max_batched_tokens=8 allows 64 scores per slice: a 24-token chunk over a 100-token
    # context is attended one query row at a time.
    runner = ModelRunner(loaded, RunnerConfig(32, BLOCK, max_batched_tokens=8))
    prompt = [(i * 7) % 200 + 3 for i in range(100)]
    got = _generate(runner, {"a": prompt}, 12, chunk=24)
    assert got["a"] == reference.greedy(tiny_model_dir, prompt, 12)


def test_decode_groups_on_a_small_pool_match_each_alone(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    # 6 blocks of gather per group: sequences of 1..5 blocks split into several groups.
    prompts = {f"s{i}": [(i * 13 + j) % 150 + 5 for j in range(4 + 9 * i)] for i in range(4)}
    need = sum(-(-(len(p) + 10) // BLOCK) for p in prompts.values())
    runner = ModelRunner(loaded, RunnerConfig(need, BLOCK, max_batched_tokens=256))
    assert len(group_decodes([(0, [0] * need, 1), (1, [0] * 2, 1)], 6)) == 2
    got = _generate(runner, prompts, 10, chunk=256)
    for seq_id, prompt in prompts.items():
        assert got[seq_id] == reference.greedy(tiny_model_dir, prompt, 10), seq_id


@given(st.lists(st.integers(1, 12), min_size=1, max_size=30), st.integers(12, 40))
def test_decode_groups_cover_every_row_once_within_the_cap(
    lengths: list[int], max_blocks: int
) -> None:
    entries = [(row, [0] * n, n * BLOCK) for row, n in enumerate(lengths)]
    groups = group_decodes(entries, max_blocks)
    assert sorted(row for g in groups for row, _, _ in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(len(t) for _, t, _ in g) <= max_blocks
