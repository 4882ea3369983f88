"""Decode steps replayed as CUDA graphs.

On a GPU a small model's decode step is bound by launching kernels, not by reading weights:
SmolLM2's 30 layers launch some 400 of them, and eager PyTorch took 15.7 ms a step on an
H200 that reads the weights in 0.07 ms (README, Speed). A CUDA graph captures a step's
kernels once and replays them in one launch. A graph fixes every shape and address, so a
graphed step is a padded one:

    batch     rows padded up to a captured size (1, 2, 4, 8, 16, 24, 32, ...); a padding row
              computes token 0 at position 0 into a scratch block that the runner allocates
              past the scheduler's blocks, and its logits are dropped;
    context   each row's block table padded to a captured width (128, 256, ... tokens, up to
              ``max_context``): attention masks the padding, one decode group for the batch;
    inputs    one static tensor per graph that a step copies its token ids, positions,
              slots, lengths and block tables into (one host-to-device copy) before replay.

Steps that do not fit (prefill chunks, drafts, more rows or a longer context than captured)
run eagerly as before. Every graph shares one memory pool, captured largest first, so they
hold about what the largest step's activations take.

``GraphSizes(eager=True)`` runs the same padded steps without capturing (on any device): the
CPU tests' way to check the padding, which decides every graphed token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from canteen.logging import get_logger
from worker.attention.interface import DecodeGroup, PagedBatch

log = get_logger(__name__)

# (input_ids [T], positions [T], batch, rows to keep [R]) -> logits [R, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, PagedBatch, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GraphSizes:
    """Which decode steps run as graphs: up to ``max_batch`` rows of up to ``max_context``
    tokens of context each."""

    max_batch: int = 32
    max_context: int = 2048
    min_context: int = 128  # the narrowest captured block table, in tokens
    eager: bool = False  # run the padded steps without capture (tests)

    def batches(self) -> list[int]:
        """Captured batch sizes: 1, 2, 4, then every multiple of 8, then max_batch."""
        sizes = {b for b in (1, 2, 4) if b <= self.max_batch}
        sizes |= set(range(8, self.max_batch + 1, 8)) | {self.max_batch}
        return sorted(sizes)

    def widths(self, block_size: int, max_model_len: int) -> list[int]:
        """Captured block-table widths, in blocks: doubling from ``min_context`` tokens up to
        the longest context a graph serves."""
        longest = -(-min(self.max_context, max_model_len) // block_size)
        width, widths = max(self.min_context // block_size, 1), []
        while width < longest:
            widths.append(width)
            width *= 2
        return [*widths, longest]


DEFAULT_GRAPHS = GraphSizes()


@dataclass
class DecodeRow:
    """One sequence's decode token: its id, position, slot, and the blocks it attends over."""

    token_id: int
    position: int
    slot: int
    block_ids: list[int]


@dataclass
class _Graph:
    inputs: torch.Tensor  # [ids | positions | slots | lens | tables], each batch long
    logits: torch.Tensor | None
    graph: torch.cuda.CUDAGraph | None


def _bucket(n: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv_pool: torch.Tensor,
        scratch_block: int,
        max_model_len: int,
        sizes: GraphSizes,
    ) -> None:
        self.forward = forward
        self.kv_pool = kv_pool
        self.block_size = int(kv_pool.shape[3])
        self.scratch_block = scratch_block
        self.eager = sizes.eager
        self.batches = sizes.batches()
        self.widths = sizes.widths(self.block_size, max_model_len)
        self.device = kv_pool.device
        longest = self.widths[-1] * self.block_size
        self._cols = torch.arange(longest, device=self.device)
        self._offsets = torch.arange(self.block_size, device=self.device)
        self._rows = torch.arange(self.batches[-1], device=self.device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0  # steps run through a graph (or its eager stand-in)
        if not self.eager:
            self._capture_all()

    def fits(self, num_rows: int, longest_context: int) -> bool:
        return num_rows <= self.batches[-1] and longest_context <= self.widths[-1] * self.block_size

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits [len(rows), vocab] of one decode step over ``rows``."""
        width_needed = max(len(r.block_ids) for r in rows)
        batch, width = _bucket(len(rows), self.batches), _bucket(width_needed, self.widths)
        graph = self._graphs.get((batch, width))
        if graph is None:  # eager mode builds its padded buffers on first use
            graph = self._graphs[batch, width] = self._new(batch, width)
        graph.inputs.copy_(self._host_inputs(rows, batch, width))
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.logits = self._body(batch, width, graph.inputs)
        self.replays += 1
        assert graph.logits is not None
        return graph.logits[: len(rows)]

    def _host_inputs(self, rows: list[DecodeRow], batch: int, width: int) -> torch.Tensor:
        """``rows`` padded to ``batch`` rows of ``width`` blocks: a padding row computes token
        0 at position 0 into the scratch block's first slot, and attends over that slot."""
        n = len(rows)
        flat = torch.zeros(4 * batch + batch * width, dtype=torch.long)
        flat[2 * batch : 3 * batch] = self.scratch_block * self.block_size
        flat[3 * batch : 4 * batch] = 1
        flat[4 * batch :] = self.scratch_block
        if n:
            flat[:n] = torch.tensor([r.token_id for r in rows])
            flat[batch : batch + n] = torch.tensor([r.position for r in rows])
            flat[2 * batch : 2 * batch + n] = torch.tensor([r.slot for r in rows])
            flat[3 * batch : 3 * batch + n] = torch.tensor([r.position + 1 for r in rows])
        tables = flat[4 * batch :].view(batch, width)
        for i, r in enumerate(rows):
            tables[i, : len(r.block_ids)] = torch.tensor(r.block_ids)
        return flat

    def _body(self, batch: int, width: int, inputs: torch.Tensor) -> torch.Tensor:
        """The padded step over static ``inputs``: what a graph captures."""
        ids, positions = inputs[:batch], inputs[batch : 2 * batch]
        slot_mapping, lens = inputs[2 * batch : 3 * batch], inputs[3 * batch : 4 * batch]
        tables = inputs[4 * batch :].view(batch, width)
        slots = (tables.unsqueeze(-1) * self.block_size + self._offsets).flatten()
        valid = self._cols[: width * self.block_size] < lens.unsqueeze(1)  # [B, L]
        bias = torch.zeros(valid.shape, dtype=self.kv_pool.dtype, device=self.device)
        group = DecodeGroup(
            index=self._rows[:batch],
            block_tables=tables,
            mask=valid[:, None, None, :],
            slots=slots,
            bias=bias.masked_fill_(~valid, float("-inf")).unsqueeze(1),
            lens=lens,
        )
        step = PagedBatch(self.kv_pool, slot_mapping, max_scores=1, decodes=[group])
        return self.forward(ids, positions, step, self._rows[:batch])

    def _new(self, batch: int, width: int) -> _Graph:
        """Static inputs holding padding rows only, until a step copies its own in."""
        return _Graph(self._host_inputs([], batch, width).to(self.device), None, None)

    def _capture_all(self) -> None:
        """Captures every (batch, width) pair, largest first, into one memory pool."""
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for batch in reversed(self.batches):
                for width in reversed(self.widths):
                    self._graphs[batch, width] = self._capture(batch, width, pool)
        torch.cuda.synchronize(self.device)
        log.info(
            "decode steps captured as CUDA graphs",
            graphs=len(self._graphs),
            batches=self.batches,
            widths_tokens=[w * self.block_size for w in self.widths],
            seconds=round(time.perf_counter() - started, 2),
            memory_mib=round((torch.cuda.memory_reserved(self.device) - reserved) / 2**20, 1),
        )

    def _capture(self, batch: int, width: int, pool: Any) -> _Graph:
        graph = self._new(batch, width)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # lazy initialization happens here, outside the capture
            self._body(batch, width, graph.inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph, pool=pool):
            graph.logits = self._body(batch, width, graph.inputs)
        return graph
