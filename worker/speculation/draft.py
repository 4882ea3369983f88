"""A draft model: a second, cheaper model in the same worker that proposes draft tokens.

It shares the target's tokenizer and block ids but keeps its own paged KV pool. For each
sequence it remembers how many leading tokens its pool holds; before proposing it catches up
on the rest (a whole prompt the first time, after a preemption or a move), then proposes k
tokens greedily, one batched forward each. After verification only the KV of drafts that
held stays counted; the next catch-up overwrites the rest. Drafts only choose what the
target verifies, so a poor or stale draft costs speed, never a token.

A draft that is the target's own weights at a lower precision (``--draft-model`` naming the
served model with ``--draft-quantization int4``) computes nearly the target's keys and values,
so it reads the target's pool instead of keeping one (``shared_pool``): it never catches up,
and switching drafts on costs nothing. It computes only what the target has not (the last
token; a prompt when drafts ride on its prefill) and its drafts, at positions the target's
verifying forward rewrites before it attends, so the target never reads a key the draft
wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention.batch import BatchBuilder, Row, new_kv_pool
from worker.engine.sampler import greedy_tokens
from worker.model.loader import LoadedModel


def can_share_kv(target: LoadedModel, draft: LoadedModel, same_weights: bool) -> bool:
    """Whether ``draft`` may read the target's pool: the same weights (a lower-precision copy
    of the served model), the same pool layout and the same forward."""
    layout = ("num_layers", "num_kv_heads", "head_dim", "dtype", "device", "forward_name")
    return same_weights and all(getattr(target, a) == getattr(draft, a) for a in layout)


@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    tokens: list[int]  # everything the sequence holds now
    block_ids: list[int]  # room for at least len(tokens) + k - 1 tokens
    k: int
    num_computed: int = 0  # leading tokens whose KV the target's pool holds


class DraftModel:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        max_batched_tokens: int,
        max_group_blocks: int,
        shared_pool: torch.Tensor | None = None,
    ) -> None:
        self.loaded = loaded
        self.shares_kv = shared_pool is not None
        self.kv_pool = (
            shared_pool if shared_pool is not None else new_kv_pool(loaded, num_blocks, block_size)
        )
        self.builder = BatchBuilder(
            self.kv_pool, block_size, max_batched_tokens, max_group_blocks, loaded.dtype
        )
        self.max_batched_tokens = max_batched_tokens
        self._computed: dict[str, int] = {}  # leading tokens whose KV this pool holds

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Greedy draft tokens per sequence (a sequence too far behind catches up first)."""
        rows, ready, budget = [], [], self.max_batched_tokens
        for r in requests:
            # A shared pool holds the KV of the tokens the target computed.
            known = r.num_computed if self.shares_kv else self._computed.get(r.seq_id, 0)
            done = min(known, len(r.tokens) - 1)
            if len(r.tokens) - done > budget:
                continue  # a long catch-up waits for a step with room
            budget -= len(r.tokens) - done
            rows.append(Row(r.tokens[done:], done, r.block_ids, 1))
            ready.append(r)
        drafts: dict[str, list[int]] = {r.seq_id: [] for r in ready}
        for i in range(max((r.k for r in ready), default=0)):
            if i > 0:  # feed each sequence its previous draft
                ready = [r for r in ready if r.k > i]
                rows = [
                    Row([drafts[r.seq_id][-1]], len(r.tokens) + i - 1, r.block_ids, 1)
                    for r in ready
                ]
            for r, token in zip(ready, self._greedy(rows), strict=True):
                drafts[r.seq_id].append(token)
                self._computed[r.seq_id] = len(r.tokens) + i
        return drafts

    def verified(self, seq_id: str, num_tokens_before: int, num_kept: int) -> None:
        """Of the drafts fed after ``num_tokens_before`` tokens, ``num_kept - 1`` held."""
        if seq_id in self._computed:
            held = num_tokens_before + num_kept - 1
            self._computed[seq_id] = min(self._computed[seq_id], held)

    def drop(self, seq_id: str) -> None:
        self._computed.pop(seq_id, None)

    def reset(self) -> None:
        self._computed.clear()

    def _greedy(self, rows: list[Row]) -> list[int]:
        batch, input_ids, positions, keep = self.builder.build(rows)
        with torch.inference_mode():
            keep_t = torch.tensor(keep, device=self.loaded.device)
            logits = self.loaded.forward(input_ids, positions, batch, keep_t)
        return greedy_tokens(logits)
