"""Graphed decode steps (worker/engine/graphs.py): the padded static step a CUDA graph captures,
run here without capture, gives the eager forward's tokens and writes no block it was not
given. The capture itself needs a GPU: bench/device_check.py compares it there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.runner import generate
from tests.unit.test_fast_forward import PROMPTS, _build, _reference
from worker import kernels
from worker.attention.paged import layer_view
from worker.config import WorkerConfig
from worker.engine.graphs import GraphSizes
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import load_model

BLOCK = 8
NUM_BLOCKS = 32


def test_captured_sizes_cover_every_batch_and_context_up_to_the_limits() -> None:
    assert GraphSizes(32).batches() == [1, 2, 4, 8, 16, 24, 32]
    assert GraphSizes(3).batches() == [1, 2, 3]
    assert GraphSizes(20).batches() == [1, 2, 4, 8, 16, 20]
    assert GraphSizes(32, 2048).widths(16, 8192) == [8, 16, 32, 64, 128]
    assert GraphSizes(32, 2048).widths(16, 1000) == [8, 16, 32, 63]  # the model's context
    assert GraphSizes(32, 100).widths(16, 8192) == [7]


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_padded_decode_steps_give_the_eager_forwards_tokens(
    model_type: str, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sequences padded to a batch of 4 and to captured widths; the fourth joins; a
    context past max_context sends the step back to the eager forward. ``torch``: Canteen's
    CPU kernels off, the ops a GPU runs."""
    if path == "torch":
        monkeypatch.setattr(kernels, "available", lambda: False)
    weights = _build(tmp_path / model_type, model_type)
    loaded = load_model(str(weights), "safetensors", "", torch.device("cpu"), torch.float32, False)
    sizes = GraphSizes(max_batch=4, max_context=32, min_context=16, eager=True)
    graphed = ModelRunner(loaded, RunnerConfig(NUM_BLOCKS, BLOCK, 256, graphs=sizes))
    plain = ModelRunner(loaded, RunnerConfig(NUM_BLOCKS, BLOCK, 256, graphs=None))
    assert graphed.graphs is not None and plain.graphs is None
    three = {k: PROMPTS[k] for k in ("p0", "p1", "p2")}  # 5, 12 and 19 tokens
    assert generate(graphed, three, 10) == generate(plain, three, 10)
    assert graphed.graphs.replays == 9  # step 1 prefills; the longest context is 28 tokens
    assert (
        ModelRunner(loaded, RunnerConfig(NUM_BLOCKS, BLOCK, 256)).graphs is None
    )  # CUDA only by default
    before = graphed.graphs.replays
    assert generate(graphed, PROMPTS, 10) == generate(plain, PROMPTS, 10)
    # step k computes p3's (26 tokens) position 24 + k: steps 2-7 fit 32 tokens, 8-10 not
    assert graphed.graphs.replays - before == 6
    for seq_id, prompt in three.items():
        assert generate(graphed, {seq_id: prompt}, 6)[seq_id] == _reference(weights, prompt, 6)


def test_padding_rows_write_only_the_scratch_block(tmp_path: Path) -> None:
    """Blocks no sequence holds are NaN before the steps and still NaN after: padding rows
    write into the scratch block past the scheduler's, and the padded columns a row attends
    over read nothing the scheduler may hand out."""
    weights = _build(tmp_path / "llama", "llama")
    loaded = load_model(str(weights), "safetensors", "", torch.device("cpu"), torch.float32, False)
    sizes = GraphSizes(max_batch=8, max_context=64, min_context=16, eager=True)
    runner = ModelRunner(loaded, RunnerConfig(NUM_BLOCKS, BLOCK, 256, graphs=sizes))
    assert runner.kv_pool.shape[2] == NUM_BLOCKS + 1  # the scratch block
    assert runner.ledger.num_blocks == NUM_BLOCKS
    three = {k: PROMPTS[k] for k in ("p0", "p1", "p2")}
    held = 3 * runner.blocks_for(19 + 10)  # generate() hands each sequence a run of blocks
    # Canteen's forward views each layer's pool head-major: slots of one head contiguous
    slots = [layer_view(runner.kv_pool, i) for i in range(loaded.num_layers)]
    for view in slots:
        view[:, :, held * BLOCK : NUM_BLOCKS * BLOCK] = float("nan")
    tokens = generate(runner, three, 10)
    assert runner.graphs is not None and runner.graphs.replays == 9
    for view in slots:
        assert torch.isnan(view[:, :, held * BLOCK : NUM_BLOCKS * BLOCK]).all()
        assert not torch.isnan(view[:, :, : held * BLOCK]).any()
    plain = ModelRunner(loaded, RunnerConfig(NUM_BLOCKS, BLOCK, 256, graphs=None))
    assert tokens == generate(plain, three, 10)


def test_a_cpu_worker_captures_nothing_and_the_flags_are_checked() -> None:
    assert WorkerConfig().graph_sizes == GraphSizes(32, 2048)
    assert WorkerConfig(cuda_graph_max_batch=0).graph_sizes is None
    with pytest.raises(ValueError, match=r"cuda_graph_max_batch.*0\.\.512"):
        WorkerConfig(cuda_graph_max_batch=-1)
    with pytest.raises(ValueError, match="cuda_graph_max_context"):
        WorkerConfig(cuda_graph_max_context=0)
