"""Copies between the paged KV pool and tier bytes, a step's blocks at a time.

A block's bytes are its K and V rows of every layer, in the pool's dtype and layout
(``block_view``). Both directions move all of a step's blocks with one gather or one
``index_copy_``, so a GPU pays one transfer and one launch per step, not per block.
"""

from __future__ import annotations

import torch


def block_view(pool: torch.Tensor, block: int, head_major: bool) -> torch.Tensor:
    """Every layer's K and V rows of ``block``. The pool is allocated as [layers, 2, blocks,
    block_size, kv_heads, D]; Canteen's own forward reads each layer's share head-major
    instead (worker/attention/paged.py), so there a block's slots are
    [layers, 2, kv_heads, block*bs : (block+1)*bs, D]."""
    layers, _, blocks, size, kv_heads, dim = pool.shape
    if not head_major:
        return pool[:, :, block]
    slots = pool.view(layers, 2, kv_heads, blocks * size, dim)
    return slots[:, :, :, block * size : (block + 1) * size]


def blocks_bytes(pool: torch.Tensor, blocks: list[int], head_major: bool) -> list[bytes]:
    """Each block's ``block_view`` as bytes, gathered in one copy (a block at a time cost
    4 ms of CPU per SmolLM2 block here: 60 small strided copies each)."""
    layers, _, num_blocks, size, kv_heads, dim = pool.shape
    index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    if head_major:
        heads = pool.view(layers, 2, kv_heads, num_blocks, size, dim)
        rows = heads.index_select(3, index).movedim(3, 0)  # [n, layers, 2, heads, bs, D]
    else:
        rows = pool.index_select(2, index).movedim(2, 0)  # [n, layers, 2, bs, heads, D]
    raw = rows.contiguous().cpu().view(torch.uint8).reshape(len(blocks), -1).numpy()
    return [raw[i].tobytes() for i in range(len(blocks))]


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of ``pool``."""
    layers, two, _, size, kv_heads, dim = pool.shape
    return layers * two * size * kv_heads * dim * pool.element_size()


def load_blocks(
    pool: torch.Tensor, blocks: list[int], payloads: list[bytes], head_major: bool
) -> None:
    """Writes ``payloads[i]`` into ``blocks[i]`` (each exactly ``block_bytes`` long): one
    staging copy of them all (one host-to-device transfer on a GPU), then one
    ``index_copy_`` into the pool."""
    if not blocks:
        return
    layers, _, num_blocks, size, kv_heads, dim = pool.shape
    staged = bytearray().join(payloads)  # writable, so torch can view it without a copy
    raw = torch.frombuffer(staged, dtype=torch.uint8).view(pool.dtype)
    index = torch.tensor(blocks, dtype=torch.long, device=pool.device)
    if head_major:  # [n, layers, 2, heads, bs, D] into [layers, 2, heads, blocks, bs, D]
        src = raw.view(len(blocks), layers, 2, kv_heads, size, dim).to(pool.device)
        heads = pool.view(layers, 2, kv_heads, num_blocks, size, dim)
        heads.index_copy_(3, index, src.movedim(0, 3))
    else:  # [n, layers, 2, bs, heads, D] into [layers, 2, blocks, bs, heads, D]
        src = raw.view(len(blocks), layers, 2, size, kv_heads, dim).to(pool.device)
        pool.index_copy_(2, index, src.movedim(0, 2))
