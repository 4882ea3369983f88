"""KV pool sizing from a memory budget."""

from __future__ import annotations

import pytest
import torch

from worker.engine.memory import MARGIN_FRACTION, Baseline, MemoryBudgetError, size_pool

MIB = 2**20
CPU = Baseline(torch.device("cpu"), offered_bytes=1000 * MIB, held_bytes=200 * MIB)


def test_fraction_gives_kv_what_weights_and_warm_up_leave() -> None:
    size = size_pool(CPU, 400 * MIB, MIB, memory_fraction=0.5, kv_cache_bytes=0, num_blocks=0)
    budget = 200 * MIB + 500 * MIB  # held before loading + half the available RAM
    assert size.budget_bytes == budget
    assert size.num_blocks == int(budget - 400 * MIB - MARGIN_FRACTION * budget) // MIB
    assert size.peak_bytes + size.kv_bytes <= budget


def test_fraction_too_small_names_the_numbers() -> None:
    with pytest.raises(MemoryBudgetError, match=r"memory_fraction=0.1: the budget of 300.0 MiB"):
        size_pool(CPU, 400 * MIB, MIB, memory_fraction=0.1, kv_cache_bytes=0, num_blocks=0)


def test_kv_cache_memory_is_whole_blocks_and_the_budget_adds_the_peak() -> None:
    size = size_pool(
        CPU, 400 * MIB, 3 * MIB, memory_fraction=0, kv_cache_bytes=100 * MIB, num_blocks=0
    )
    assert size.num_blocks == 33 and size.kv_bytes == 99 * MIB
    assert size.budget_bytes >= 499 * MIB


def test_num_kv_blocks_overrides_both() -> None:
    size = size_pool(
        CPU, 400 * MIB, MIB, memory_fraction=0.5, kv_cache_bytes=10 * MIB, num_blocks=7
    )
    assert (size.num_blocks, size.kv_bytes) == (7, 7 * MIB)


def test_kv_cache_memory_below_one_block_is_refused() -> None:
    with pytest.raises(MemoryBudgetError, match="one KV block needs 4096 bytes"):
        size_pool(CPU, 0, 4096, memory_fraction=0, kv_cache_bytes=100, num_blocks=0)
