"""A draft model: a second, cheaper model in the same worker that proposes draft tokens.

It shares the target's tokenizer and block ids but keeps its own paged KV pool. For each
sequence it remembers how many leading tokens its pool holds; before proposing it catches up
on the rest (a whole prompt the first time, after a preemption or a move), then proposes k
tokens greedily, one batched forward each. After verification only the KV of drafts that
held stays counted; the next catch-up overwrites the rest. Drafts only choose what the
target verifies, so a poor or stale draft costs speed, never a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.batch import BatchBuilder, Row, new_kv_pool
from worker.loader import LoadedModel


@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    tokens: list[int]  # everything the sequence holds now
    block_ids: list[int]  # room for at least len(tokens) + k - 1 tokens
    k: int


class DraftModel:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        max_batched_tokens: int,
        max_group_blocks: int,
    ) -> None:
        self.loaded = loaded
        self.kv_pool = new_kv_pool(loaded, num_blocks, block_size)
        self.builder = BatchBuilder(
            self.kv_pool, block_size, max_batched_tokens, max_group_blocks, loaded.dtype
        )
        self.max_batched_tokens = max_batched_tokens
        self._computed: dict[str, int] = {}  # leading tokens whose KV this pool holds

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Greedy draft tokens per sequence (a sequence too far behind catches up first)."""
        rows, ready, budget = [], [], self.max_batched_tokens
        for r in requests:
            done = min(self._computed.get(r.seq_id, 0), len(r.tokens) - 1)
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
        result: list[int] = logits.float().argmax(dim=-1).tolist()
        return result
