"""BlockPool and BatchLimits: allocation, double frees, and bounds named in errors."""

from __future__ import annotations

from typing import Any

import pytest

from canteen.batching import BatchConfig
from scheduler.blocks import BlockPool


def test_allocate_takes_nothing_when_too_few_are_free() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    taken = pool.allocate(3)
    assert taken == [0, 1, 2] and pool.num_free == 1
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and pool.num_used == 3
    assert pool.allocate(1) == [3]


def test_double_free_raises_naming_the_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(ValueError, match="block 1 freed twice"):
        pool.free([1])
    assert pool.num_free == 4


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (17, 5)])
def test_blocks_for_rounds_up(num_tokens: int, blocks: int) -> None:
    assert BlockPool(num_blocks=8, block_size=4).blocks_for(num_tokens) == blocks


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
    ],
)
def test_block_pool_rejects_empty_sizes(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=0"):
        BlockPool(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batched_tokens": 0}, "max_batched_tokens=0"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"watermark_blocks": -1}, "watermark_blocks=-1"),
    ],
)
def test_batch_limits_reject_bad_values(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BatchConfig(**kwargs)
