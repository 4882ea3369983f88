"""Speculative decoding on the worker: draft tokens proposed from a sequence's own text, and
the rule that verifies them.

The scheduler grants a decoding sequence up to k draft tokens (and the blocks for them). The
worker proposes them by prompt lookup: the longest recent n-gram that ends the sequence is
looked up earlier in its prompt and output, and the tokens that followed it there are the
draft. One forward computes the sequence's last token and the drafts together; position i's
logits are then sampled exactly as a step without speculation would sample that position,
with the same (seed, position) randomness. The draws are kept up to and including the first
that differs from its draft. A draft is a point mass, so this is rejection sampling (accept
with the target's probability, else draw from the rest), and more: the kept tokens are the
very tokens a run without speculation makes, greedy or seeded, on any worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SPECULATIVE_KINDS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculationConfig:
    kind: str = "none"  # "none", "ngram" or "draft" (a draft model, worker/speculation/draft.py)
    num_tokens: int = 4  # most draft tokens per sequence and step
    max_ngram: int = 4  # longest suffix looked up
    min_ngram: int = 2  # shortest suffix that counts as a match

    def __post_init__(self) -> None:
        if self.kind not in SPECULATIVE_KINDS:
            raise ValueError(f"speculative={self.kind!r}: must be one of {SPECULATIVE_KINDS}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_tokens}: must be in 1..16")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"ngram sizes {self.min_ngram}..{self.max_ngram}: min <= max")

    @property
    def is_on(self) -> bool:
        return self.kind != "none"


def propose_ngram(tokens: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (``max_n`` down to ``min_n`` tokens long); [] when none occurs."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        # windows starting at 0..len-n-1: every occurrence that ends before the suffix does
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return [int(t) for t in arr[start : start + k]]
    return []


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified run keeps: the target's draws up to and including the first one
    that differs from its draft (all of them, plus the bonus draw, when every draft holds)."""
    kept = []
    for i, token in enumerate(sampled):
        kept.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return kept
