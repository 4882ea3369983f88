"""The preparation pool: tokenizing, chat templates and grammar compiles, off the event loop.

A few threads (HF tokenizers and llguidance release the GIL while they work) with a bound
on the requests waiting for one, and a deadline per preparation. So a slow request costs its
own latency only: other streams, requests and health probes keep the event loop.

    submit ─► [running: threads] [waiting: queue] ─► full: PrepBusyError (429)
                     └─ past the deadline: PrepDeadlineError (504), the thread finishes alone
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class PrepBusyError(Exception):
    """Every preparation thread is busy and the queue is full: RESOURCE_EXHAUSTED, 429."""

    def __init__(self, num_threads: int, queue: int) -> None:
        super().__init__(
            f"the gateway is busy preparing other requests: {num_threads} threads busy and "
            f"{queue} waiting, the limit (--prep-queue {queue}); retry shortly"
        )


class PrepDeadlineError(Exception):
    """One preparation took longer than its deadline: DEADLINE_EXCEEDED, 504."""

    def __init__(self, what: str, deadline: float) -> None:
        super().__init__(f"{what} took longer than the limit of {deadline:g} s (--prep-deadline)")


class PrepPool:
    def __init__(self, num_threads: int, queue: int, deadline: float) -> None:
        self.num_threads = num_threads
        self.queue = queue
        self.deadline = deadline
        self.num_pending = 0
        """Preparations running or waiting, counted until their thread is done (one past
        its deadline still holds a thread, so it still counts)."""
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="canteen-prep")

    async def run(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a preparation thread; ``what`` names it in a deadline error."""
        if self.num_pending >= self.num_threads + self.queue:
            raise PrepBusyError(self.num_threads, self.queue)
        self.num_pending += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, fn)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.deadline)
        except TimeoutError:
            raise PrepDeadlineError(what, self.deadline) from None

    def _done(self, future: asyncio.Future[Any]) -> None:
        self.num_pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a late failure is not logged as never retrieved

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
