"""Canteen's own forward against transformers, per family, on tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.runner import generate
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import load_model
from worker.model.quant import GROUP_SIZE, Int4Linear, Q4Groups

BLOCK = 8
VOCAB = 256
PROMPTS = {
    f"p{i}": [(i * 37 + j * 11) % (VOCAB - 3) + 3 for j in range(5 + 7 * i)] for i in range(4)
}
FAMILY_EXTRAS: dict[str, dict[str, object]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False, "head_dim": 16},
    "granite": {
        "embedding_multiplier": 3.0,
        "attention_multiplier": 0.2,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    },
    "olmo2": {},
}


def _build(path: Path, model_type: str, seed: int = 0) -> Path:
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **FAMILY_EXTRAS[model_type],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # sharp logits: greedy tokens depend on the prompt
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)  # qwen2's q/k/v biases start at zero: make them count
    model.save_pretrained(path)
    return path


def _reference(path: Path, prompt: list[int], new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize("model_type", sorted(FAMILY_EXTRAS))
def test_every_family_decodes_the_tokens_of_transformers(model_type: str, tmp_path: Path) -> None:
    path = _build(tmp_path / model_type, model_type)
    loaded = load_model(str(path), "safetensors", "", torch.device("cpu"), torch.float32, False)
    assert loaded.forward_name == ("transformers" if model_type == "olmo2" else "fast")
    runner = ModelRunner(loaded, RunnerConfig(4 * 8, BLOCK, max_batched_tokens=256))
    batched = generate(runner, PROMPTS, 10)
    for seq_id, prompt in PROMPTS.items():
        alone = generate(runner, {seq_id: prompt}, 10)[seq_id]
        assert batched[seq_id] == alone == _reference(path, prompt, 10), seq_id


def test_int4_layout_carries_q4_1_values_exactly() -> None:
    torch.manual_seed(0)
    rows, cols = 48, 3 * GROUP_SIZE
    groups = Q4Groups(
        torch.randint(0, 16, (rows, cols), dtype=torch.uint8),
        torch.rand(rows, cols // GROUP_SIZE).half().float(),  # Q4_1's d and m are float16
        torch.randn(rows, cols // GROUP_SIZE).half().float(),
    )
    weights = Int4Linear(groups, None, torch.float32).fallback(torch.eye(cols)).T  # torch's
    # The kernel computes (q - 8) * d + (m + 8 d): the same real number as Q4_1's d * q + m,
    # rounded to float32 by a different sum: apart by at most the rounding of the group's
    # largest term.
    codes = groups.q.view(rows, -1, GROUP_SIZE).float() - 8
    kernel_sum = codes * groups.d.unsqueeze(-1) + (groups.m + 8 * groups.d).unsqueeze(-1)
    assert torch.equal(weights, kernel_sum.view(rows, cols))
    bound = ((groups.m.abs() + 16 * groups.d) * 2**-23).repeat_interleave(GROUP_SIZE, dim=1)
    assert torch.all((weights - groups.dequantize()).abs() <= bound)


def test_quantization_flags_are_checked_where_they_are_read() -> None:
    from worker.config import WorkerConfig

    with pytest.raises(ValueError, match="quantization"):
        WorkerConfig(quantization="int3")
    with pytest.raises(ValueError, match="dtype"):
        WorkerConfig(quantization="int4", dtype="float32")
    assert WorkerConfig(quantization="int4").dtype == "auto"


@pytest.mark.parametrize(
    ("quantization", "dtype"),
    [
        ("none", torch.bfloat16),
        ("none", torch.float32),
        ("int8", torch.bfloat16),
        ("int4", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "granite"])
def test_decode_layers_in_one_op_equal_the_layer_by_layer_path(
    model_type: str, quantization: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """canteen::decode_layers (worker/kernels/stack.cpp) runs every layer's ops in one call:
    the hidden states before the head are the Layer loop's bit for bit, in decode steps of
    one row and of four (bfloat16 and float32 through skinny_linear, int8 and int4 through
    quant_linear; qwen2's biases, granite's residual multiplier)."""
    from worker.model.forward import FastModel

    path = _build(tmp_path / model_type, model_type)
    loaded = load_model(
        str(path), "safetensors", "", torch.device("cpu"), dtype, False,
        quantization=quantization,
    )  # fmt: skip
    model = loaded.forward
    assert isinstance(model, FastModel) and model.stack is not None
    stack, norm = model.stack, model.norm
    assert norm is not None
    runner = ModelRunner(loaded, RunnerConfig(4 * 8, BLOCK, max_batched_tokens=256))
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    tokens: dict[bool, list[dict[str, list[int]]]] = {True: [], False: []}
    for use in (True, False):
        model.stack = stack if use else None
        model.norm = lambda x, use=use: seen[use].append(x.clone()) or norm(x)  # type: ignore[func-returns-value]
        for prompts in (PROMPTS, {"p2": PROMPTS["p2"]}):
            tokens[use].append(generate(runner, prompts, 6))
    model.stack, model.norm = stack, norm
    assert tokens[True] == tokens[False]
    assert len(seen[True]) == len(seen[False]) == 12
    for fused, layered in zip(seen[True], seen[False], strict=True):
        assert torch.equal(fused, layered)


def test_qk_norms_keep_the_layer_by_layer_path(tmp_path: Path) -> None:
    from worker.model.forward import FastModel

    path = _build(tmp_path / "qwen3", "qwen3")
    loaded = load_model(str(path), "safetensors", "", torch.device("cpu"), torch.bfloat16, False)
    assert isinstance(loaded.forward, FastModel) and loaded.forward.stack is None
