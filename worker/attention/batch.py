"""One step's forward inputs over a paged KV pool: token rows in, a ``PagedBatch`` out.

The runner builds the target model's steps with it, and the draft model
(worker/speculation/draft.py) its own over its own pool with the same block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention.interface import DecodeGroup, PagedBatch, PrefillSpan
from worker.model.arena import huge_zeros
from worker.model.loader import LoadedModel


def new_kv_pool(loaded: LoadedModel, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed paged pool for ``loaded``: [layers, 2, blocks, block_size, kv_heads, D], on
    huge pages on a CPU (worker/model/arena.py)."""
    shape = (loaded.num_layers, 2, num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
    if loaded.device.type == "cpu":
        return huge_zeros(shape, loaded.dtype)
    return torch.zeros(shape, dtype=loaded.dtype, device=loaded.device)


# A few tokens after cached ones (a sequence verifying its drafts, a short prompt chunk) go
# through the decode path, one row per token over the slots up to its own position: the
# pool already holds the step's keys when attention reads it, so each row sees exactly its
# causal past. On the CPU that is Canteen's in-place kernel instead of gathering the
# context's keys and values in every layer, and a verified token's attention is computed as
# it would be without drafts.
SHORT_SPAN = 8


@dataclass(frozen=True)
class Row:
    """One sequence's part of a forward: ``token_ids`` at positions ``start..``, written into
    ``block_ids``; the logits of its last ``num_logits`` tokens are kept."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_logits: int


class BatchBuilder:
    def __init__(
        self,
        kv_pool: torch.Tensor,
        block_size: int,
        max_batched_tokens: int,
        max_group_blocks: int,
        dtype: torch.dtype,
    ) -> None:
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.max_batched_tokens = max_batched_tokens
        self.max_group_blocks = max_group_blocks
        self.dtype = dtype
        self.device = kv_pool.device
        self._offsets = torch.arange(block_size, device=self.device)  # a block's slot offsets

    def build(self, rows: list[Row]) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, list[int]]:
        """(batch, input ids, positions, the flat indices of the kept logits, in order)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        decodes: list[tuple[int, list[int], int]] = []
        spans: list[tuple[int, int, int, list[int]]] = []
        bs = self.block_size
        for r in rows:
            start, end = r.start, r.start + len(r.token_ids)
            first = len(ids)
            ids.extend(r.token_ids)
            pos.extend(range(start, end))
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if end - start == 1 or (start > 0 and end - start <= SHORT_SPAN):
                for i, p in enumerate(range(start + 1, end + 1)):  # each token over its past
                    decodes.append((first + i, r.block_ids[: (p + bs - 1) // bs], p))
            else:
                spans.append((first, end - start, end, r.block_ids[: (end + bs - 1) // bs]))
            keep.extend(range(len(ids) - r.num_logits, len(ids)))
        # ids, positions and slots in one tensor [3, T]: one copy from Python, three rows
        input_ids, positions, slot_mapping = torch.tensor(
            [ids, pos, slots], dtype=torch.long, device=self.device
        ).unbind()
        batch = PagedBatch(
            kv_pool=self.kv_pool,
            slot_mapping=slot_mapping,
            max_scores=self.max_batched_tokens**2,
            decodes=[self._decode_group(g) for g in group_decodes(decodes, self.max_group_blocks)],
            prefills=[self._prefill_span(*span) for span in spans],
        )
        return batch, input_ids, positions, keep

    def _slots(self, block_tables: torch.Tensor) -> torch.Tensor:
        """[..., n] block ids -> [..., n * block_size] slot ids, in token order."""
        return (block_tables.unsqueeze(-1) * self.block_size + self._offsets).flatten(-2)

    def _prefill_span(self, start: int, q_len: int, ctx_len: int, blocks: list[int]) -> PrefillSpan:
        device = self.device
        block_ids = torch.tensor(blocks, dtype=torch.long, device=device)
        return PrefillSpan(
            start,
            q_len,
            ctx_len,
            block_ids,
            self._slots(block_ids)[:ctx_len],
            rows=torch.arange(start, start + q_len, device=device),
            lens=torch.arange(ctx_len - q_len + 1, ctx_len + 1, device=device),
        )

    def _decode_group(self, group: list[tuple[int, list[int], int]]) -> DecodeGroup:
        device = self.device
        width = max(len(table) for _, table, _ in group)
        padded = [table + [0] * (width - len(table)) for _, table, _ in group]
        block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        # rows and lengths in one tensor: [2, B] -> index, lens
        index, lens = torch.tensor(
            [[r for r, _, _ in group], [n for _, _, n in group]], device=device
        ).unbind()
        return DecodeGroup(
            index=index,
            block_tables=block_tables,
            slots=self._slots(block_tables).flatten(),
            lens=lens,
        )


def group_decodes(
    decodes: list[tuple[int, list[int], int]], max_blocks: int
) -> list[list[tuple[int, list[int], int]]]:
    """Splits (row, block table, length) entries into groups that gather <= max_blocks blocks.

    Entries are sorted by table length, so each group pads little; a group's cost is its size
    times its longest table.
    """
    groups: list[list[tuple[int, list[int], int]]] = []
    current: list[tuple[int, list[int], int]] = []
    for entry in sorted(decodes, key=lambda e: len(e[1])):
        if current and (len(current) + 1) * len(entry[1]) > max_blocks:
            groups.append(current)
            current = []
        current.append(entry)
    if current:
        groups.append(current)
    return groups
