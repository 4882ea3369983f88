"""Attention over the paged KV pool for Canteen's own forward (worker/model/forward.py).

The runner's pool is one contiguous tensor; this path views each layer's share head-major,
so that the keys of any set of slots come out of one ``index_select`` already in the layout
a batched matmul wants:

    pool[layer]  : [2, kv_heads, num_slots, head_dim]     slot = block * block_size + offset
    decode group : keys = pool[layer, 0].index_select(1, slots) -> [kv_heads, B, L, head_dim]
                   scores = q [kv_heads, B, group, D] @ keys^T  (no per-head copies, no
                   repeat of the shared KV heads)

The slot indices are built once per step (worker/attention/batch.py), and the padding bias on a
torch path's first layer, and shared by every layer. On the CPU, every query goes to Canteen's
own kernel (``torch.ops.canteen.paged_decode_into``, worker/kernels/), which reads each row's
slots in place: a decode row over its own slots, each query of a prefill chunk over its
sequence's slots up to its own position. One kernel for every query, reducing over keys in
position order, so a token's attention output is the same bits whichever step computed it
(README, Exactness). Elsewhere, or without the kernel, torch has no op that reads blocks in
place, so each layer copies the keys and values it attends over once: measured here (1 thread,
batch 16, 112 tokens of context, bfloat16) that copy is 43 us of the 220 us a layer's decode
attention takes, where indexing ``pool[block_tables]`` into transformers' SDPA path took 2,060
us.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker import kernels
from worker.attention.interface import DecodeGroup, PagedBatch, PrefillSpan


def layer_view(kv_pool: torch.Tensor, layer: int) -> torch.Tensor:
    """The runner's [layers, 2, blocks, block_size, kv_heads, D] pool, viewed head-major."""
    _, _, blocks, size, kv_heads, dim = kv_pool.shape
    return kv_pool[layer].view(2, kv_heads, blocks * size, dim)


def paged_attention(
    pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PagedBatch,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, D], k and v [T, kv_heads, D] -> [T, heads * D]; writes k, v to the pool."""
    pool[0].index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
    pool[1].index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if q.device.type == "cpu" and kernels.available():
        # Canteen's kernel: each query from q straight into out, slots read in place
        q = q.contiguous()
        for slots, lens, rows, tables in kernel_groups(batch):
            each = tables if tables.numel() else None  # None: row b reads table b
            torch.ops.canteen.paged_decode_into(out, q, pool, slots, lens, rows, scale, each)
        return out
    for group in batch.decodes:
        rows = q.index_select(0, group.index)
        out.index_copy_(0, group.index, _decode(pool, rows, group, scale))
    for span in batch.prefills:
        end = span.start + span.q_len
        chunk = slice(span.start, end)
        out[chunk] = _prefill(pool, q[chunk], k[chunk], v[chunk], span, scale, batch.max_scores)
    return out


# Most slot entries the one merged table of a step's queries may hold (2 MiB of int64): it
# is padded to the longest table, and many short decode rows beside one long context would
# pad to far more than they read.
MAX_MERGED_SLOTS = 1 << 18


def kernel_groups(batch: PagedBatch) -> list[tuple[torch.Tensor, ...]]:
    """The step's queries as paged_decode_into takes them: (slots [S, W], lens [B], rows [B],
    tables [B], or empty where row b reads table b); built on the first layer's call and
    kept on the batch for the others. Where the padded table stays within MAX_MERGED_SLOTS,
    every decode row and every prefill chunk's rows go in one call, so that each layer's
    attention is one parallel region whose threads split the rows by their keys, not one
    region per group where a chunk's few long rows keep one thread busy while the other
    waits; else one call per decode group and per prefill chunk."""
    if batch.kernel is None:
        none = torch.empty(0, dtype=torch.long)
        groups: list[tuple[torch.Tensor, ...]] = [
            (g.slots.view(g.lens.shape[0], -1), g.lens, g.index, none) for g in batch.decodes
        ]
        for span in batch.prefills:
            table = span.slots.view(1, -1)
            groups.append((table, span.lens, span.rows, torch.zeros_like(span.rows)))
        batch.kernel = merged(groups) or groups
    return batch.kernel


def merged(groups: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    """``groups`` as one (slots, lens, rows, tables) entry, or none where that table would
    pad past MAX_MERGED_SLOTS (or there is only one group)."""
    if len(groups) < 2:
        return []
    width = max(slots.shape[1] for slots, *_ in groups)
    num_tables = sum(slots.shape[0] for slots, *_ in groups)
    if num_tables * width > MAX_MERGED_SLOTS:
        return []
    table = groups[0][0].new_zeros(num_tables, width)
    tables, first = [], 0
    for slots, lens, _, each in groups:
        table[first : first + slots.shape[0], : slots.shape[1]] = slots
        own = torch.arange(lens.shape[0], device=lens.device) if not each.numel() else each
        tables.append(own + first)
        first += slots.shape[0]
    lens = torch.cat([g[1] for g in groups])
    return [(table, lens, torch.cat([g[2] for g in groups]), torch.cat(tables))]


def _decode(pool: torch.Tensor, q: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
    """One new token per row in torch ops: q [B, heads, D] over each row's slots, gathered,
    then batched matmuls -> [B, heads * D]."""
    rows, heads, dim = q.shape
    kv_heads = pool.shape[1]
    width = group.slots.numel() // rows
    keys = pool[0].index_select(1, group.slots).view(kv_heads, rows, width, dim)
    values = pool[1].index_select(1, group.slots).view(kv_heads, rows, width, dim)
    dtype = q.dtype
    if q.device.type == "cpu":
        # A bfloat16 batched matmul JIT-builds a oneDNN kernel for every new shape (~5 ms and
        # ~0.7 MiB each; see worker/model/quant.py), and the width here changes with every block
        # the context grows: float32 goes to MKL, which keeps nothing per shape.
        q, keys, values = q.float(), keys.float(), values.float()
    grouped = (q * scale).view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).add_(group.padding_bias(dtype))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, B, group, D]
    return out.transpose(0, 1).reshape(rows, heads * dim).to(dtype)


def _prefill(
    pool: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    max_scores: int,
) -> torch.Tensor:
    """A chunk of ``q_len`` tokens after ``ctx_len - q_len`` cached ones -> [q_len, heads * D]."""
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q, D]
    if span.ctx_len == span.q_len:  # nothing cached: plain causal over the fresh keys
        out = F.scaled_dot_product_attention(
            q4,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(span.q_len, -1)
    keys = pool[0].index_select(1, span.slots).unsqueeze(0)  # [1, kv_heads, ctx, D]
    values = pool[1].index_select(1, span.slots).unsqueeze(0)
    offset = span.ctx_len - span.q_len
    cols = torch.arange(span.ctx_len, device=q.device).unsqueeze(0)
    # bounded transient memory, as worker/attention/interface.py
    step = max(max_scores // span.ctx_len, 1)
    parts = []
    for lo in range(0, span.q_len, step):
        hi = min(lo + step, span.q_len)
        rows = torch.arange(lo, hi, device=q.device).unsqueeze(1) + offset
        part = F.scaled_dot_product_attention(
            q4[:, :, lo:hi], keys, values, attn_mask=cols <= rows, scale=scale, enable_gqa=True
        )
        parts.append(part[0].transpose(0, 1).reshape(hi - lo, -1))
    return torch.cat(parts)
