"""A step's attention as Canteen's kernel takes it (worker/attention/paged.py): every decode
row and every prefill chunk's rows in one call, split between threads by their keys, with
each query's bits those of the calls per group."""

from __future__ import annotations

import pytest
import torch

from worker import kernels
from worker.attention import paged
from worker.attention.batch import BatchBuilder, Row
from worker.attention.interface import PagedBatch

BLOCK, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 16, 3, 9, 64, 200


def setup_module() -> None:
    assert kernels.available(), "Canteen's CPU kernels did not build (is g++ installed?)"


def chunk_step(chunk: int, position: int) -> tuple[torch.Tensor, PagedBatch, int]:
    """A pool, and the batch of a step with 8 decode rows over 150 keys each beside a prompt
    chunk of ``chunk`` tokens after ``position`` computed ones (its number of rows too)."""
    g = torch.Generator().manual_seed(chunk + position)
    pool = torch.randn(1, 2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    builder = BatchBuilder(pool, BLOCK, 2048, 129, torch.bfloat16)
    rows = [Row([1], 150, list(range(10 * i, 10 * i + 10)), 1) for i in range(8)]
    blocks = list(range(80, 80 + (position + chunk + BLOCK - 1) // BLOCK))
    rows.append(Row([1] * chunk, position, blocks, 1))
    batch, ids, _, _ = builder.build(rows)
    return pool, batch, int(ids.shape[0])


def attend(pool: torch.Tensor, batch: PagedBatch, num_rows: int, threads: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(num_rows)
    q = torch.randn(num_rows, HEADS, DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(num_rows, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(num_rows, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return paged.paged_attention(paged.layer_view(pool, 0), q, k, v, batch, DIM**-0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("chunk", "position"), [(3, 1900), (40, 600)])
def test_a_chunk_step_attends_in_one_call_with_the_bits_of_one_call_per_group(
    chunk: int, position: int
) -> None:
    """3 tokens go as decode rows (one group each), 40 as a prefill span: either way the
    step is one call, and every row's output is the same bits as group by group, on one
    thread or two."""
    pool, batch, num_rows = chunk_step(chunk, position)
    groups = paged.kernel_groups(batch)
    assert len(groups) == 1
    slots, lens, rows, tables = groups[0]
    assert rows.tolist() == list(range(num_rows))  # decode rows first, then the chunk's
    assert lens.tolist() == [151] * 8 + list(range(position + 1, position + chunk + 1))
    # a table per decode row, and the chunk's: one per row as decode rows, one as a span
    assert slots.shape[0] == 8 + (chunk if chunk <= 8 else 1)
    for b in range(num_rows):  # each row reads its own sequence's slots, in position order
        table = slots[tables[b], : lens[b]]
        block = 10 * b if b < 8 else 80
        assert table[:BLOCK].tolist() == list(range(block * BLOCK, (block + 1) * BLOCK))
    one_call = [attend(pool, batch, num_rows, t) for t in (1, 2)]
    pool2, apart, _ = chunk_step(chunk, position)
    apart.kernel = None
    saved, paged.MAX_MERGED_SLOTS = paged.MAX_MERGED_SLOTS, 0  # one call per group
    try:
        by_group = attend(pool2, apart, num_rows, 2)
        assert len(apart.kernel or []) == len(apart.decodes) + len(apart.prefills) > 1
    finally:
        paged.MAX_MERGED_SLOTS = saved
    assert torch.equal(one_call[0], by_group)
    assert torch.equal(one_call[1], by_group)
