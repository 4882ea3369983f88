"""Keeps Python's cyclic garbage collector from pausing a serving process for long.

A worker holds some 390,000 objects once the model is loaded (torch, transformers, the
tokenizer); a full collection walks them all: 206-211 ms of CPU on the AMD EPYC (Zen 4) of
README, Speed. Python starts one whenever enough new objects survived, in whichever step
allocated the last of them, so every stream of that step waited for it: the interference
bench's single 336 ms gap beside a long prompt's prefill (its later 65-86 ms gaps were
protobuf's periodic ``malloc_trim``: canteen/malloc.py). What start-up built
lives as long as the process, so once a service is ready it is moved out of the collector's
sight (``gc.freeze``, as production Python servers do after start-up, vLLM's engine
included); a full collection then walks only what was made since (0.0 ms right after).

Full collections that still take over ``SLOW_COLLECTION_MS`` are logged with their generation and
duration, so that a stall can be told apart from a slow step in the services' logs. What
loads after readiness is as long-lived: the worker builds its grammar tokenizer on a thread
once ready (worker/engine/constrain.py), and its full collections then took 120, 210, 302,
345 ms, growing, freeing nothing. So a slow full collection that freed (almost) nothing
freezes what it walked too, at most ``MAX_LATE_FREEZES`` times (what is frozen is never
collected: a cycle among those objects that dies later stays, so this stays rare). A loader
that knows when it is done says so (``freeze_loaded``) and freezes what it built at once,
before any collection walks it (the worker's log still showed full collections of 186 and
158 ms in its first 20 s after readiness). Since the worker now waits for that load before it
is ready, this covers loads that outlast the wait.
"""

from __future__ import annotations

import gc
import time

from canteen.logging import get_logger

log = get_logger(__name__)

SLOW_COLLECTION_MS = 20.0
MAX_LATE_FREEZES = 4
MOSTLY_LIVE = 100  # a full collection that freed at most this many objects walked live ones

_started_ns = 0
_is_frozen = False
_num_late_freezes = 0


def freeze_startup_heap() -> None:
    """Collects start-up's garbage once, then freezes what is left and watches the
    collector's pauses; later calls do nothing (readiness may flip back and forth)."""
    global _is_frozen
    if _is_frozen:
        return
    _is_frozen = True
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.callbacks.append(_watch)
    log.info(
        "start-up heap frozen",
        num_objects=gc.get_freeze_count(),
        collect_ms=round((time.perf_counter() - started) * 1e3, 1),
    )


def freeze_loaded(what: str) -> None:
    """Freezes what a loader built after readiness (``what`` names it in the log), before a
    full collection walks it; before readiness the start-up freeze will take it."""
    if not _is_frozen:
        return
    before = gc.get_freeze_count()
    gc.freeze()
    log.info("loaded heap frozen", what=what, num_objects=gc.get_freeze_count() - before)


def _watch(phase: str, info: dict[str, int]) -> None:
    global _started_ns, _num_late_freezes
    if phase == "start":
        _started_ns = time.perf_counter_ns()
        return
    ms = (time.perf_counter_ns() - _started_ns) / 1e6
    generation, collected = info.get("generation"), info.get("collected", 0)
    # Younger generations walk at most a few thousand objects: a slow one was the host
    # taking the core away, not the heap.
    if generation != 2 or ms <= SLOW_COLLECTION_MS:
        return
    late = collected <= MOSTLY_LIVE and _num_late_freezes < MAX_LATE_FREEZES
    if late:  # it walked long-lived objects made since the start-up freeze
        _num_late_freezes += 1
        gc.freeze()
    log.warning(
        "slow garbage collection",
        generation=generation,
        ms=round(ms, 1),
        num_collected=collected,
        is_frozen_after=late,
        num_frozen=gc.get_freeze_count(),
    )
