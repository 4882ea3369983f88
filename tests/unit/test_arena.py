"""worker/model/arena.py: a CPU model's kernel weights moved into one block in step order, and
the KV pool on huge pages, change where bytes live and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.runner import generate
from tests.support.tiny_model import build_tiny_model
from worker.attention.batch import new_kv_pool
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model import forward
from worker.model.arena import ALIGN, HUGE_PAGE, gather, huge_zeros
from worker.model.forward import FastModel
from worker.model.loader import load_model

PROMPTS = {f"p{i}": [(i * 31 + j * 7) % 500 + 3 for j in range(6 + 5 * i)] for i in range(3)}


def test_gather_moves_tensors_in_order_and_every_holder_sees_them() -> None:
    a = torch.arange(10, dtype=torch.float16)
    b = torch.randint(0, 255, (3, 5), dtype=torch.uint8)
    c = torch.randn(4, 7).bfloat16()
    listed, held = [a], {"c": c}
    values = [t.clone() for t in (a, b, c)]
    moved = gather([a, b, torch.empty(0), a, c])  # a repeat and an empty one: skipped
    assert moved == sum(-(-t.nbytes // ALIGN) * ALIGN for t in (a, b, c))
    for t, want in zip((a, b, c), values, strict=True):
        assert torch.equal(t, want) and t.dtype == want.dtype and t.shape == want.shape
    assert listed[0] is a and torch.equal(held["c"], values[2])
    storage = a.untyped_storage().data_ptr()
    assert b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() == storage
    assert a.data_ptr() % HUGE_PAGE == 0  # the block starts on a huge page
    assert b.data_ptr() == a.data_ptr() + ALIGN  # 20 bytes of a, padded to one line
    assert c.data_ptr() == b.data_ptr() + ALIGN


def test_gather_refuses_what_it_cannot_move() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensors that do not require grad"):
        gather([torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="contiguous"):
        gather([torch.zeros(4, 6).t()])
    assert gather([]) == 0


def test_huge_zeros_is_a_zeroed_tensor_on_a_huge_page_boundary() -> None:
    pool = huge_zeros((2, 3, 1000), torch.bfloat16)
    assert pool.shape == (2, 3, 1000) and pool.dtype == torch.bfloat16
    assert pool.data_ptr() % HUGE_PAGE == 0 and pool.is_contiguous()
    assert not pool.any()


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_gathered_model_computes_the_same_tokens_and_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str
) -> None:
    """The same model loaded twice, with its weights left where the loader put them and
    gathered: the same greedy tokens, the same logits bit for bit, every kernel tensor in
    one storage."""
    path = build_tiny_model(tmp_path / "m")
    runs: dict[bool, tuple[dict[str, list[int]], torch.Tensor]] = {}
    for gathered in (False, True):
        if not gathered:
            monkeypatch.setattr(forward, "gather", lambda tensors: 0)
        else:
            monkeypatch.undo()
        loaded = load_model(
            str(path), "safetensors", "", torch.device("cpu"), torch.bfloat16, False,
            quantization=quantization,
        )  # fmt: skip
        model = loaded.forward
        assert isinstance(model, FastModel)
        storages = {t.untyped_storage().data_ptr() for t in model._read_order()}
        assert (len(storages) == 1) == gathered
        runner = ModelRunner(loaded, RunnerConfig(8 * 8, 8, max_batched_tokens=256))
        tokens = generate(runner, PROMPTS, 6)
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
        with torch.inference_mode():
            logits = model.lm_head(x)
        runs[gathered] = tokens, logits
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])


def test_the_cpu_kv_pool_starts_zeroed_on_huge_pages(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m")
    loaded = load_model(str(path), "safetensors", "", torch.device("cpu"), torch.float32, False)
    pool = new_kv_pool(loaded, num_blocks=5, block_size=8)
    assert pool.shape == (loaded.num_layers, 2, 5, 8, loaded.num_kv_heads, loaded.head_dim)
    assert pool.dtype == torch.float32 and pool.data_ptr() % HUGE_PAGE == 0
    assert not pool.any()
