"""Runs the model's work on the process's main thread while gRPC runs on another.

Measured here: the same decode step ran about 1.5x slower when torch was driven from a
secondary thread than from the main thread (see README, "Speed"). So the worker inverts the
usual layout: the asyncio loop with the gRPC server lives in a helper thread and hands
every load, warm-up and step to the main thread through this executor, and the forward
pass still never blocks the event loop.

The two threads share the GIL. A step releases it inside every torch op, and the gRPC thread
then runs (a result's protobuf and write, the next plan's read), but when the step's op
returns it waits for the GIL until that thread blocks or Python's switch interval (5 ms by
default) asks it to let go: after a one-row step the engine sat about half a millisecond
between steps (canteen_worker_idle_seconds{cause="handoff"}). The engine sets a short
interval, so the gRPC thread's work spreads over the step's GIL-free kernels instead of
holding the step back.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

# Seconds a thread waiting for the GIL lets its holder run before asking for it (sys.
# setswitchinterval; Python's default 0.005).
ENGINE_SWITCH_INTERVAL = 0.0002

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class MainThreadExecutor(Executor):
    """An executor whose calls run, one at a time, on the thread in ``run_forever``."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.put(None)

    def run_forever(self) -> None:
        """Runs submitted calls until ``shutdown``, with the GIL's switch interval set short
        for the process (above)."""
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL)
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # delivered to the awaiting coroutine
                future.set_exception(exc)
