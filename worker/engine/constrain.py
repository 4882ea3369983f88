"""Constrained sequences on a worker: one llguidance matcher each, and the token masks.

A constrained sequence's logits are masked before sampling, so it can only pick a token that
continues a valid output; when its grammar is complete only end-of-sequence tokens remain,
and the scheduler stops it there. Unconstrained rows are never touched, so they sample
exactly what they would alone. A matcher's state is a function of the tokens generated so
far: a sequence resumed after a preemption or a failover replays them into a fresh matcher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch
from transformers import AutoTokenizer

from canteen.grammar import ConstraintError, GrammarCompiler
from canteen.plan import Constraint
from worker.engine.guard import EntryError


def load_tokenizer(path: str, fmt: str) -> Any:
    weights = Path(path)
    if fmt == "gguf":
        return AutoTokenizer.from_pretrained(str(weights.parent), gguf_file=weights.name)
    return AutoTokenizer.from_pretrained(str(weights))


class Constraints:
    """The matchers of this worker's constrained sequences, by sequence id."""

    def __init__(self, load: Callable[[], Any], vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._load = load
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # the tokenizer loads on the first constrained sequence
            self._compiler = GrammarCompiler(self._load(), self.vocab_size, self.eos_ids)
        return self._compiler

    def add(self, seq_id: str, constraint: Constraint, generated: Sequence[int]) -> None:
        """Starts ``seq_id``'s matcher and replays the tokens it generated before a resume."""
        try:
            matcher = self.compiler.matcher(constraint)
        except ConstraintError as exc:
            raise EntryError(seq_id, str(exc)) from None
        for token in generated:
            if not matcher.consume_token(token):
                raise EntryError(seq_id, f"token {token} does not fit its {constraint.kind}")
        self._matchers[seq_id] = matcher

    def drop(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def clear(self) -> None:
        self._matchers.clear()

    def has_any(self, seq_ids: Sequence[str]) -> bool:
        return bool(self._matchers) and any(s in self._matchers for s in seq_ids)

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[str]) -> None:
        """Sets to -inf, in place, every logit a row's grammar does not allow next."""
        vocab = logits.shape[-1]
        rows, allowed = [], []
        for row, seq_id in enumerate(seq_ids):
            matcher = self._matchers.get(seq_id)
            if matcher is not None:
                rows.append(row)
                allowed.append(self._allowed(matcher, vocab))
        index = torch.tensor(rows, device=logits.device)
        blocked = torch.from_numpy(~np.stack(allowed)).to(logits.device)
        logits[index] = logits[index].masked_fill_(blocked, float("-inf"))

    def advance(self, seq_id: str, token: int) -> None:
        matcher = self._matchers.get(seq_id)
        if matcher is not None:
            matcher.consume_token(token)

    def _allowed(self, matcher: llguidance.LLMatcher, vocab: int) -> np.ndarray:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if len(allowed) < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - len(allowed), dtype=bool)])
        if matcher.is_error() or not allowed.any():
            # a matcher that can go nowhere ends the sequence rather than emit free text
            allowed[:] = False
            allowed[[e for e in self.eos_ids if e < vocab]] = True
        return allowed
