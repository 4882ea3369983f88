"""A CPU model's packed weights in one block of memory, in the order a step reads them, on
transparent huge pages where the kernel allows them.

A decode step of one row reads every weight once (about 100 MB for SmolLM2 at 4 bits) in 121
linears of 0.2-1 MB each. Allocated one by one, each sat on its own 4 KiB pages and every call
started cold: torch's own ``sum`` reads those 96 MB at 18 GB/s as 120 tensors against 32 GB/s
as one (AMD EPYC Zen 4, 2 cores, 2026-12-07). Laid end to end on 2 MiB pages, the step's
weights are one stream: the in-process one-row step took 0.93x and 0.96x its time before, a
16-row step (compute-bound) the same (docs/speed-history.md).

Only where the bytes live changes: every tensor keeps its dtype, shape and values, and the
kernels read them as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from pathlib import Path

import torch

from canteen.logging import get_logger

log = get_logger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor on a cache line of its own
MADV_HUGEPAGE = 14  # Linux


def _thp_mode() -> str:
    """Linux's transparent huge page setting, e.g. ``always [madvise] never``; "" unknown."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""


def _advise_huge(address: int, length: int) -> bool:
    """Asks Linux for transparent huge pages over [address, address + length) (before the
    first touch: pages already faulted in stay small until khugepaged merges them)."""
    if not sys.platform.startswith("linux") or "[never]" in _thp_mode():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return bool(madvise(address, length, MADV_HUGEPAGE) == 0)


def _huge_block(nbytes: int) -> tuple[torch.Tensor, bool]:
    """``nbytes`` of uint8 starting on a 2 MiB boundary, advised for huge pages before anything
    touches them; whether the advice was taken."""
    block = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -block.data_ptr() % HUGE_PAGE
    return block[start : start + nbytes], _advise_huge(block.data_ptr() + start, nbytes)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on transparent huge pages where the kernel allows them (the KV pool:
    a step's attention reads blocks spread over all of it)."""
    block, _ = _huge_block(math.prod(shape) * dtype.itemsize)
    return block.view(dtype).view(shape).zero_()


def gather(tensors: list[torch.Tensor]) -> int:
    """Moves ``tensors`` (CPU, contiguous, not requiring grad) into one block, in list order,
    each in place (``set_``: every holder of a tensor sees the new storage); repeats, empty
    and non-CPU tensors are left where they are. Returns the bytes moved."""
    todo: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t.numel() == 0 or t.device.type != "cpu":
            continue
        if not t.is_contiguous() or t.requires_grad:
            raise ValueError("gather takes contiguous CPU tensors that do not require grad")
        todo.setdefault(id(t), t)
    sizes = [-(-t.nbytes // ALIGN) * ALIGN for t in todo.values()]
    total = sum(sizes)
    if total == 0:
        return 0
    block, huge = _huge_block(total)
    offset = 0
    for t, size in zip(todo.values(), sizes, strict=True):
        view = block[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        with torch.no_grad():
            t.set_(view)  # type: ignore[call-overload]
        offset += size
    log.info("weights gathered", tensors=len(todo), bytes=total, huge_pages=huge)
    return total
