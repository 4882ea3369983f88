"""Routing across workers: prefix-cache affinity while there is room, else free blocks."""

from __future__ import annotations

from scheduler.batcher import BatchScheduler
from scheduler.router import pick_worker
from tests.unit.test_prefix_cache import KVWorker, make, run, seq

SYSTEM = list(range(10, 30))  # 20 tokens: 5 full blocks of 4


def warm(num_blocks: int, prompt: list[int]) -> tuple[BatchScheduler, KVWorker]:
    core = make(num_blocks)
    worker = KVWorker()
    core.add(seq("warm", prompt))
    run(core, worker)
    return core, worker


def test_a_cached_prefix_wins_over_more_free_blocks() -> None:
    cold = make(64)
    hot, _ = warm(32, [*SYSTEM, 1, 2])
    assert pick_worker([cold, hot], [*SYSTEM, 7, 8, 9]) == 1


def test_the_longest_cached_prefix_wins() -> None:
    short, _ = warm(32, [*SYSTEM[:8], 1])
    long, _ = warm(32, [*SYSTEM, 1])
    assert pick_worker([short, long], [*SYSTEM, 5]) == 1


def test_without_a_cache_hit_the_most_headroom_wins() -> None:
    small, large = make(16), make(48)
    assert pick_worker([small, large], [1, 2, 3, 4, 5]) == 1
    large.add(seq("queued", list(range(100, 260))))  # 40 blocks waiting: 8 left
    assert pick_worker([small, large], [1, 2, 3, 4, 5]) == 0


def test_a_full_or_backlogged_cached_worker_spills_over() -> None:
    hot, _ = warm(8, [*SYSTEM, 1])  # 5 cached blocks, 8 total
    cold = make(64)
    prompt = SYSTEM + list(range(40, 80))  # 15 blocks: 10 uncached, hot has 8
    assert pick_worker([hot, cold], prompt) == 1
    roomy, _ = warm(64, [*SYSTEM, 1])
    roomy.add(seq("waiting", list(range(200, 204))))
    assert pick_worker([roomy, cold], [*SYSTEM, 3]) == 1


def test_no_candidates_means_no_worker() -> None:
    assert pick_worker([], [1, 2]) is None
