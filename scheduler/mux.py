"""Requests multiplexed on one stream: a gateway's ``Connect`` call submits and cancels
requests as messages, and their tokens ride its subscription.

A Generate call per request costs both sides a call's setup, its metadata, deadline and
interceptors, and a handler task; on a stream of short requests that fixed cost was a third
of the CPU a token cost. Here a request is a message: it runs as a task of the connection
(the same ``SchedulerService.generate`` path, so admission, preemption, failover and the
release of its blocks are those of a Generate call), its tokens and final entry go to the
subscription as before, and its failure comes back as an entry of its own (``fail``), the
status its own call would have ended with.

The connection enforces each request's deadline itself (no call carries it), counts its
requests in the server's drain (a draining scheduler refuses new ones, retryably, and
finishes the running ones), and cancels every request when the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import structlog
from opentelemetry.context import Context

from canteen.request import Request
from scheduler.sequence import SeqEvent
from scheduler.subscriptions import Subscription

# How the caller learns that a request failed: (tag, the exception) -> an entry for it.
OnError = Callable[[int, Exception], None]


class Generate(Protocol):
    """``SchedulerService.generate``."""

    def __call__(
        self,
        params: Request,
        trace_context: Context | None,
        feed: tuple[Subscription, int, int] | None,
    ) -> AsyncGenerator[SeqEvent]: ...


class InFlight(Protocol):
    """The server's count of running work that a drain waits for."""

    def enter(self) -> None: ...
    def exit(self) -> None: ...


class Connection:
    """The running requests of one Connect stream, by tag."""

    def __init__(
        self,
        subscription: Subscription,
        generate: Generate,
        on_error: OnError,
        in_flight: InFlight | None = None,
    ) -> None:
        self.subscription = subscription
        self._generate, self._on_error, self._in_flight = generate, on_error, in_flight
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def submit(
        self,
        params: Request,
        tag: int,
        interval: int,
        timeout: float | None,
        trace_context: Context | None,
    ) -> None:
        """Starts ``params`` under ``tag``; its end (finish or failure) comes back tagged."""
        if tag in self._tasks:
            self._on_error(tag, DuplicateTagError(f"stream_tag {tag} is already in use"))
            return
        feed = (self.subscription, tag, interval)
        task = asyncio.create_task(self._run(params, tag, timeout, trace_context, feed))
        self._tasks[tag] = task
        if self._in_flight is not None:
            self._in_flight.enter()
        task.add_done_callback(lambda _: self._done(tag))

    def cancel(self, tag: int) -> None:
        """The caller gave up on ``tag``: it ends, its blocks freed; no entry follows."""
        task = self._tasks.get(tag)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """The stream ended: every running request is cancelled and waited for."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    def _done(self, tag: int) -> None:
        self._tasks.pop(tag, None)
        if self._in_flight is not None:
            self._in_flight.exit()

    async def _run(
        self,
        params: Request,
        tag: int,
        timeout: float | None,
        trace_context: Context | None,
        feed: tuple[Subscription, int, int],
    ) -> None:
        structlog.contextvars.bind_contextvars(request_id=params.request_id)
        try:
            async with asyncio.timeout(timeout):
                events = self._generate(params, trace_context, feed)
                async with contextlib.aclosing(events):
                    async for _ in events:  # tokens and the final entry go on the stream
                        pass
        except TimeoutError:
            self._on_error(tag, DeadlineError("Deadline Exceeded"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._on_error(tag, exc)


class DuplicateTagError(Exception):
    """A submit reused the tag of a request still running on the stream."""


class DeadlineError(Exception):
    """A request ran past the deadline it was submitted with."""
