"""Sizing the KV pool from a memory budget.

The worker measures before loading (what the device offers), loads the weights, runs one
forward at its largest step, measures again, and gives the KV pool what the budget leaves:

    --memory-fraction F   budget = F x (device memory on CUDA | available RAM on CPU);
                          KV     = budget - weights - warm-up peak - margin
    --kv-cache-memory B   KV     = B; budget = what the warm-up peak took + B
    --num-kv-blocks N     exactly N blocks (tests)

On CPU the figures are the process's resident set: the budget is what the worker's RSS stays
under. The runner bounds every transient buffer of a step (see
worker/attention/interface.py), so the warm-up at ``max_batched_tokens`` is the peak any
later step reaches.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from worker.model.loader import LoadedModel

# Head room for allocator fragmentation and the small per-step buffers the warm-up misses.
MARGIN_FRACTION = 0.05


class MemoryBudgetError(ValueError):
    """The budget leaves no room for even one KV block."""


@dataclass(frozen=True)
class Baseline:
    """What the device offered and what the process held before loading the model."""

    device: torch.device
    offered_bytes: int  # the device's whole memory (CUDA) or the RAM available (CPU)
    held_bytes: int  # already counted in the peak: 0 on CUDA, this process's RSS on CPU


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    kv_bytes: int
    budget_bytes: int  # the whole worker stays under this
    peak_bytes: int  # weights plus the warm-up's peak


def measure_baseline(device: torch.device) -> Baseline:
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return Baseline(device, total, 0)
    rss = psutil.Process().memory_info().rss
    return Baseline(device, psutil.virtual_memory().available, rss)


def peak_bytes(device: torch.device) -> int:
    """The most held so far: the device's used memory (CUDA), or this process's peak RSS."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(total - free, torch.cuda.max_memory_reserved(device))
    # VmHWM is this address space's peak; ru_maxrss would carry over the peak of the parent
    # that forked us (it survives execve), e.g. a large test runner.
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def size_pool(
    baseline: Baseline,
    peak: int,
    bytes_per_block: int,
    *,
    memory_fraction: float,
    kv_cache_bytes: int,
    num_blocks: int,
) -> PoolSize:
    """The pool's size under the first of --num-kv-blocks, --memory-fraction, --kv-cache-memory."""
    if num_blocks:
        kv = num_blocks * bytes_per_block
        return PoolSize(num_blocks, kv, peak + kv, peak)
    if memory_fraction:
        budget = baseline.held_bytes + int(memory_fraction * baseline.offered_bytes)
        kv = int((budget - peak) - MARGIN_FRACTION * budget)
        blocks = kv // bytes_per_block
        if blocks < 1:
            raise MemoryBudgetError(
                f"memory_fraction={memory_fraction}: the budget of {_mib(budget)} leaves "
                f"{_mib(max(kv, 0))} for KV after the weights and warm-up took {_mib(peak)}; "
                f"one block needs {_mib(bytes_per_block)}"
            )
        return PoolSize(blocks, blocks * bytes_per_block, budget, peak)
    blocks = kv_cache_bytes // bytes_per_block
    if blocks < 1:
        raise MemoryBudgetError(
            f"kv_cache_memory={kv_cache_bytes} bytes: one KV block needs {bytes_per_block} bytes"
        )
    kv = blocks * bytes_per_block
    return PoolSize(blocks, kv, peak + kv + int(MARGIN_FRACTION * (peak + kv)), peak)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    """One block's keys and values over every layer, in the model's dtype."""
    element = torch.tensor([], dtype=loaded.dtype).element_size()
    return 2 * loaded.num_layers * block_size * loaded.num_kv_heads * loaded.head_dim * element
