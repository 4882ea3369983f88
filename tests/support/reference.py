"""What transformers' own generate produces for the tiny model, one prompt at a time."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=2)
def _load(path: str) -> tuple[object, object]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    return model, AutoTokenizer.from_pretrained(path)


def tokenizer(path: Path) -> object:
    return _load(str(path))[1]


def greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens with EOS not treated as the end (like ignore_eos)."""
    model, _ = _load(str(path))
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(prompt_ids) :].tolist())
