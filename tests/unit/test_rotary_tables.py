"""The rotary tables Canteen's forward indexes hold transformers' module's values, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from worker.model.rotary import module_rotary, rotary_tables

ORIGINAL = 512  # the context the frequencies were trained for
ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


def _module(family: str, rope: dict[str, Any], max_len: int) -> torch.nn.Module:
    sizes: dict[str, Any] = {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": max_len,
        "rope_parameters": {"rope_theta": 100000.0, **rope},
    }
    if family == "llama":
        return LlamaRotaryEmbedding(LlamaConfig(**sizes)).eval()
    return Qwen2RotaryEmbedding(Qwen2Config(**sizes)).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_tables_hold_the_modules_values_at_every_step_shape(rope: str, dtype: torch.dtype) -> None:
    # the scaling types run past the original context: 4x it
    max_len = ORIGINAL if rope == "default" else 4 * ORIGINAL
    module = _module("llama", ROPES[rope], max_len)
    tables = rotary_tables(module, max_len, dtype, torch.device("cpu"))
    assert tables is not None and tables.num_positions == max_len
    with torch.no_grad():
        # one decode row at a time, every position
        for position in range(max_len):
            at = torch.tensor([position])
            cos, sin = module_rotary(module, at, dtype)
            got = tables(at)
            assert torch.equal(got[0], cos) and torch.equal(got[1], sin), position
        # rows of a wide step, and prefill chunks (a long one computed on several threads)
        for start, length in [(3, 16), (100, 32), (ORIGINAL - 7, 600), (0, max_len)]:
            at = torch.arange(start, min(start + length, max_len))
            cos, sin = module_rotary(module, at, dtype)
            got = tables(at)
            assert torch.equal(got[0], cos) and torch.equal(got[1], sin), (start, length)
        scattered = torch.tensor([max_len - 1, 0, 511, 7, max_len // 2, 7])
        cos, sin = module_rotary(module, scattered, dtype)
        got = tables(scattered)
        assert torch.equal(got[0], cos) and torch.equal(got[1], sin)


def test_qwen2s_module_gets_tables_of_its_values() -> None:
    module = _module("qwen2", ROPES["default"], 256)
    tables = rotary_tables(module, 256, torch.bfloat16, torch.device("cpu"))
    assert tables is not None
    at = torch.arange(256)
    with torch.no_grad():
        cos, sin = module_rotary(module, at, torch.bfloat16)
    assert torch.equal(tables(at)[0], cos) and torch.equal(tables(at)[1], sin)


def test_signed_sin_negates_the_first_half_only() -> None:
    module = _module("llama", ROPES["default"], 64)
    with torch.no_grad():
        _, plain = module(torch.empty(0), torch.tensor([[5]]))
        _, signed = module_rotary(module, torch.tensor([5]), torch.float32)
    half = plain.shape[-1] // 2
    assert torch.equal(signed[0, 0, :half], -plain[0, 0, :half])
    assert torch.equal(signed[0, 0, half:], plain[0, 0, half:])


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 32,
            "long_factor": [2.0] * 32,
            "original_max_position_embeddings": ORIGINAL,
        },
    ],
)
def test_frequencies_that_change_per_call_get_no_tables(rope: dict[str, Any]) -> None:
    # transformers updates these modules' frequencies from each call's longest position
    module = _module("llama", rope, 4 * ORIGINAL)
    assert rotary_tables(module, 4 * ORIGINAL, torch.bfloat16, torch.device("cpu")) is None
