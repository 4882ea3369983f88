"""Paged attention plugged into transformers through its ``AttentionInterface``.

The whole step is one flattened batch of T tokens (batch dimension 1). Each layer writes the
new keys and values into the paged pool at ``slot_mapping`` and then attends, per sequence,
over the blocks of that sequence:

    pool[layer] : [2, num_blocks, block_size, kv_heads, head_dim]
    slot s      : block s // block_size, offset s % block_size

Decode tokens (one new token per sequence) are attended in groups, each padded to its longest
context with a mask; prefill chunks are attended one sequence at a time with a causal mask
offset by the tokens already in the cache.

Transient memory is bounded whatever the batch: a decode group gathers at most the pool's
block count (the runner groups sequences of similar length), and a prefill chunk over a long
cached context is attended in query slices of at most ``max_scores`` query x key entries,
the size of a fresh ``max_batched_tokens`` chunk. So the warm-up at the largest step is the
peak (see worker/engine/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "canteen_paged"


@dataclass
class PrefillSpan:
    """One sequence computing ``q_len`` tokens after ``ctx_len - q_len`` cached ones."""

    start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor
    slots: torch.Tensor  # the ctx_len slots of the sequence, in order (worker/model/forward.py)
    rows: torch.Tensor  # [q_len] the chunk's rows of the step: start, start + 1, ...
    lens: torch.Tensor  # [q_len] each query's context: its position + 1


@dataclass
class DecodeGroup:
    """Decode rows attended together: ``block_tables`` padded, ``padding_mask`` hides the
    padding. Canteen's CPU kernel reads ``lens`` instead: the mask and the bias are built on
    a torch path's first use (or given, as a captured graph does), not every step."""

    index: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor  # [B * L] every row's slots, padded (worker/model/forward.py)
    lens: torch.Tensor  # [B] each row's context length (its slots past it are padding)
    mask: torch.Tensor | None = None  # [B, 1, 1, L] True where a row has a key
    bias: torch.Tensor | None = None  # [B, 1, L] 0 or -inf: the padding, as an additive bias

    def padding_mask(self) -> torch.Tensor:
        """[B, 1, 1, L]: True at each row's first ``lens`` slots."""
        if self.mask is None:
            width = self.slots.numel() // self.lens.shape[0]
            keys = torch.arange(width, device=self.lens.device)
            self.mask = (keys.unsqueeze(0) < self.lens.unsqueeze(1))[:, None, None, :]
        return self.mask

    def padding_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, L]: 0 at each row's first ``lens`` slots, -inf past them."""
        if self.bias is None:
            valid = self.padding_mask()[:, 0]  # [B, 1, L]
            zeros = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
            self.bias = zeros.masked_fill_(~valid, float("-inf"))
        return self.bias


@dataclass
class PagedBatch:
    """What every layer needs to read and write the pool for one step."""

    kv_pool: torch.Tensor
    slot_mapping: torch.Tensor
    max_scores: int
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # the step's queries as Canteen's attention kernel takes them, built once per step
    # (worker/attention/paged.py, kernel_groups) for every layer
    kernel: list[tuple[torch.Tensor, ...]] | None = field(default=None, repr=False)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_batch: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if paged_batch is None:
        raise RuntimeError("paged attention needs paged_batch= in the forward call")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_pool, v_pool = paged_batch.kv_pool[layer, 0], paged_batch.kv_pool[layer, 1]
    _, num_blocks_x_size = k_pool.shape[0], k_pool.shape[0] * k_pool.shape[1]
    kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    new_k = key[0].transpose(0, 1)  # [T, kv_heads, D]
    new_v = value[0].transpose(0, 1)
    k_pool.view(num_blocks_x_size, kv_heads, head_dim).index_copy_(
        0, paged_batch.slot_mapping, new_k
    )
    v_pool.view(num_blocks_x_size, kv_heads, head_dim).index_copy_(
        0, paged_batch.slot_mapping, new_v
    )

    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    for group in paged_batch.decodes:
        _attend_decode(query, k_pool, v_pool, group, scaling, out)
    for span in paged_batch.prefills:
        _attend_prefill(
            query, key, value, k_pool, v_pool, span, scaling, paged_batch.max_scores, out
        )
    return out.unsqueeze(0), None


def _gather(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, num_blocks] block ids -> [B, kv_heads, num_blocks * block_size, D]."""
    blocks = pool[block_tables]  # [B, nb, bs, kvh, D]
    b, nb, bs, kvh, d = blocks.shape
    return blocks.view(b, nb * bs, kvh, d).transpose(1, 2)


def _attend_decode(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    group: DecodeGroup,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    q = query[0][:, group.index].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
    k = _gather(k_pool, group.block_tables)
    v = _gather(v_pool, group.block_tables)
    attn = F.scaled_dot_product_attention(
        q, k, v, attn_mask=group.padding_mask(), scale=scaling, enable_gqa=True
    )
    out[group.index] = attn.squeeze(2)


def _attend_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    span: PrefillSpan,
    scaling: float | None,
    max_scores: int,
    out: torch.Tensor,
) -> None:
    end = span.start + span.q_len
    q = query[:, :, span.start : end]  # [1, H, q, D]
    if span.ctx_len == span.q_len:
        # Nothing cached before this chunk: attend over the fresh keys, plain causal.
        k, v = key[:, :, span.start : end], value[:, :, span.start : end]
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=True
        )
    else:
        k = _gather(k_pool, span.block_ids.unsqueeze(0))[:, :, : span.ctx_len]
        v = _gather(v_pool, span.block_ids.unsqueeze(0))[:, :, : span.ctx_len]
        offset = span.ctx_len - span.q_len
        cols = torch.arange(span.ctx_len, device=q.device).unsqueeze(0)
        step = max(max_scores // span.ctx_len, 1)
        for lo in range(0, span.q_len, step):
            hi = min(lo + step, span.q_len)
            rows = torch.arange(lo, hi, device=q.device).unsqueeze(1) + offset
            attn = F.scaled_dot_product_attention(
                q[:, :, lo:hi], k, v, attn_mask=cols <= rows, scale=scaling, enable_gqa=True
            )
            out[span.start + lo : span.start + hi] = attn[0].transpose(0, 1)
        return
    out[span.start : end] = attn[0].transpose(0, 1)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
