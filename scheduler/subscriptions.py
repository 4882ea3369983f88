"""Shared token streams: one per gateway, one message per step for all its requests.

A gateway opens a subscription once and names it in each Generate call with a tag of its
choosing. The worker link delivers a subscribed request's events to a ``TokenSink`` instead
of the request's own queue: tokens, and the finish with them, go to the subscription's next
batch, where events of one step for every attached request become one message; the request's
own queue gets a token-less event at its first token (its queue time is then known) and
then only the end (finish or failure), which ends its Generate call. With a stream interval
N > 1 the sink holds a request's tokens after its first until N have gathered (or it
finishes, or waits: preempted, or moving off a lost worker), so that they ride one entry
instead of N. A per-request
stream costs a message, a write and a wakeup per token; here a step costs one of each per
gateway. A subscription belongs to the connection that opened it: a call on any other
connection cannot attach to it (nor learn that it exists).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Protocol

from canteen.finish import Finish
from scheduler.sequence import SeqEvent, Sequence, joined


class EventSink(Protocol):
    """Where the worker link delivers a sequence's events (an ``asyncio.Queue`` or a sink)."""

    def put_nowait(self, item: SeqEvent, /) -> None: ...


class SubscriptionError(Exception):
    """A Generate call named a subscription this scheduler does not have open, or a tag
    already in use on it."""


class Subscription:
    """One shared stream's pending events, by tag, in the order their requests first sent."""

    def __init__(self, peer: str) -> None:
        self.id = os.urandom(16).hex()
        self.peer = peer  # the connection it was opened on: only calls on it may attach
        self.is_closed = False
        self._pending: dict[int, tuple[SeqEvent, bool]] = {}
        self._failures: list[tuple[int, Exception]] = []  # a Connect stream's, by tag
        self._ready = asyncio.Event()
        self._ends: dict[int, tuple[Sequence, EventSink]] = {}  # tag -> (seq, its own queue)

    def attach(self, tag: int, seq: Sequence, own: EventSink, interval: int = 1) -> TokenSink:
        """A sink for the request tagged ``tag``; its end also goes to ``own``; tokens after
        the first go in entries of ``interval`` tokens."""
        if self.is_closed:
            raise SubscriptionError(f"subscription_id {self.id!r} is closed")
        if tag in self._ends:
            raise SubscriptionError(f"stream_tag {tag} is already in use on this subscription")
        self._ends[tag] = (seq, own)
        return TokenSink(self, tag, own, interval)

    def detach(self, tag: int) -> None:
        self._ends.pop(tag, None)

    def push(self, tag: int, event: SeqEvent, is_first: bool) -> None:
        if self.is_closed:
            return
        held = self._pending.get(tag)
        if held is not None:  # the stream fell behind the steps: one entry per request
            before, is_first = held
            event = before.then(event)
        self._pending[tag] = (event, is_first)
        self._ready.set()

    def fail(self, tag: int, error: Exception) -> None:
        """The request tagged ``tag`` (on a Connect stream) failed with ``error``: its last
        entry, after any tokens it made before."""
        if self.is_closed:
            return
        self._failures.append((tag, error))
        self._ready.set()

    def take_failures(self) -> list[tuple[int, Exception]]:
        """The failures since the last call (taken with ``next_batch``'s events)."""
        failures, self._failures = self._failures, []
        return failures

    @property
    def has_pending(self) -> bool:
        """Whether events wait for the next batch."""
        return bool(self._pending) or bool(self._failures)

    async def next_batch(self) -> list[tuple[int, SeqEvent, bool]]:
        """Waits for events, then takes all of them: (tag, event, whether it is the
        request's first entry)."""
        await self._ready.wait()
        self._ready.clear()
        batch = [(tag, event, is_first) for tag, (event, is_first) in self._pending.items()]
        self._pending = {}
        return batch

    def close(self) -> None:
        """The stream is gone: every attached request ends as cancelled (the caller left)."""
        self.is_closed = True
        self._pending.clear()
        self._failures.clear()
        for seq, own in self._ends.values():
            own.put_nowait(SeqEvent.of(seq, finish=Finish.CANCELLED))
        self._ends.clear()


class TokenSink:
    """A subscribed request's events: tokens and the finish to the subscription, the end
    (finish or failure) to the request's own queue."""

    def __init__(
        self, subscription: Subscription, tag: int, own: EventSink, interval: int = 1
    ) -> None:
        self._subscription, self._tag, self._own = subscription, tag, own
        self._is_first = True
        self._interval = interval
        self._held: list[SeqEvent] = []  # events gathered toward the next entry
        self._num_held = 0  # their tokens

    def put_nowait(self, event: SeqEvent, /) -> None:
        if not event.token_ids and event.finish is None:
            return
        if self._interval > 1 and not self._is_first and event.finish is not Finish.FAILED:
            self._held.append(event)
            self._num_held += len(event.token_ids)
            if event.finish is None and self._num_held < self._interval:
                return
            event = joined(self._held)  # one entry of the gathered events, made once
            self._held, self._num_held = [], 0
        if event.finish is not Finish.FAILED:
            self._subscription.push(self._tag, event, self._is_first)
            if self._is_first and event.finish is None:
                # The caller learns when its request started (its queue time), not only
                # when it ends: one token-less event, once.
                self._own.put_nowait(
                    dataclasses.replace(event, token_ids=(), logprobs=(), top_logprobs=())
                )
            self._is_first = False
        if event.finish is not None:
            self._subscription.detach(self._tag)
            self._own.put_nowait(event)

    def flush(self) -> None:
        """Sends the held tokens now: the sequence waits (preempted, or moving off a lost
        worker), and its caller should not wait with it for tokens already made."""
        if self._held:
            event = joined(self._held)
            self._held, self._num_held = [], 0
            self._subscription.push(self._tag, event, False)  # held: never the first


class Subscriptions:
    """The open subscriptions of this scheduler, by id."""

    def __init__(self) -> None:
        self._open: dict[str, Subscription] = {}

    def open(self, peer: str) -> Subscription:
        subscription = Subscription(peer)
        self._open[subscription.id] = subscription
        return subscription

    def get(self, subscription_id: str, peer: str) -> Subscription:
        """The open subscription ``subscription_id``, if ``peer`` (a call's connection)
        opened it: a call from another connection is told no more than for an unknown id."""
        subscription = self._open.get(subscription_id)
        if subscription is None or subscription.peer != peer:
            raise SubscriptionError(
                f"subscription_id {subscription_id!r} is not open on this scheduler"
            )
        return subscription

    def close(self, subscription: Subscription) -> None:
        self._open.pop(subscription.id, None)
        subscription.close()
