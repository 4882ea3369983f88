"""Once a service is ready, its start-up heap is out of the collector's sight, and a slow
collection is logged (canteen/heap.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import structlog

from canteen import heap


@pytest.fixture
def fresh_heap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's collector as it was: nothing frozen, no watcher, after the test too."""
    gc.unfreeze()
    monkeypatch.setattr(heap, "_is_frozen", False)
    monkeypatch.setattr(heap, "_num_late_freezes", 0)
    callbacks = list(gc.callbacks)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.callbacks[:] = callbacks


def test_ready_freezes_what_start_up_built_once(fresh_heap: None) -> None:
    start_up = [[i] for i in range(50_000)]  # containers: what the collector walks
    heap.freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen >= len(start_up)
    assert not any(o is start_up for o in gc.get_objects(2))  # no generation holds it now
    assert gc.callbacks.count(heap._watch) == 1
    heap.freeze_startup_heap()  # readiness flipped again: nothing more is frozen or watched
    assert gc.get_freeze_count() == frozen
    assert gc.callbacks.count(heap._watch) == 1


def test_a_slow_full_collection_is_logged_and_a_young_one_is_not(
    fresh_heap: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    heap.freeze_startup_heap()
    monkeypatch.setattr(heap, "SLOW_COLLECTION_MS", -1.0)  # every collection is "slow"
    with structlog.testing.capture_logs() as logs:
        gc.collect(1)  # a few thousand objects at most: slow only if the host took the core
    assert logs == []
    with structlog.testing.capture_logs() as logs:
        gc.collect(2)
    slow = [e for e in logs if e["event"] == "slow garbage collection"]
    assert [e["generation"] for e in slow] == [2]
    monkeypatch.setattr(heap, "SLOW_COLLECTION_MS", 1e9)
    with structlog.testing.capture_logs() as logs:
        gc.collect(2)
    assert logs == []


def test_a_slow_full_collection_of_live_objects_freezes_them_a_bounded_number_of_times(
    fresh_heap: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What loads after readiness (the worker's grammar tokenizer) is as long-lived as
    start-up's heap: the first slow full collection that frees nothing freezes it."""
    heap.freeze_startup_heap()
    frozen = gc.get_freeze_count()
    loaded_later = [[i] for i in range(20_000)]
    monkeypatch.setattr(heap, "SLOW_COLLECTION_MS", -1.0)
    with structlog.testing.capture_logs() as logs:
        for _ in range(heap.MAX_LATE_FREEZES + 2):
            gc.collect()
    assert gc.get_freeze_count() >= frozen + len(loaded_later)
    slow = [e for e in logs if e["event"] == "slow garbage collection"]
    assert [e["is_frozen_after"] for e in slow] == [True] * heap.MAX_LATE_FREEZES + [False] * 2
    # A full collection that frees garbage is not a reason to freeze what it walked.
    monkeypatch.setattr(heap, "_num_late_freezes", 0)
    for _ in range(heap.MOSTLY_LIVE + 1):
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
    with structlog.testing.capture_logs() as logs:
        gc.collect()
    assert [e["is_frozen_after"] for e in logs] == [False]


def test_what_loads_after_readiness_is_frozen_when_its_loader_is_done(fresh_heap: None) -> None:
    """The worker's grammar tokenizer loads on a thread after readiness: frozen as its load
    ends, no full collection walks it; a load that ends before readiness waits for the
    start-up freeze."""
    early = [[i] for i in range(10_000)]
    heap.freeze_loaded("early")
    assert gc.get_freeze_count() == 0
    heap.freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen >= len(early)
    loaded_later = [[i] for i in range(20_000)]
    with structlog.testing.capture_logs() as logs:
        heap.freeze_loaded("grammar tokenizer")
    assert gc.get_freeze_count() >= frozen + len(loaded_later)
    assert not any(o is loaded_later for o in gc.get_objects(2))
    assert [(e["event"], e["what"]) for e in logs] == [("loaded heap frozen", "grammar tokenizer")]
    assert logs[0]["num_objects"] >= len(loaded_later)
