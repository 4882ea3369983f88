"""Requests multiplexed on the gateway's one ``Connect`` stream to the scheduler.

A request is a message on the stream (``submit``), not a Generate call of its own: the call
setup, metadata, deadline and interceptors a call costs both processes, per request, are
gone. Its tokens come tagged on the stream's batches as on ``Subscribe``; its failure comes
as an entry of its own carrying the status its call would have ended with, raised here as
the same ``AioRpcError`` (the scheduler's verdicts marked final, as their trailers were), so
the retry, failover and error mapping above see no difference. The deadline is kept here
(a timer that ends the request with DEADLINE_EXCEEDED, as a call's deadline would) and sent
along for the scheduler's own; leaving early sends a ``cancel``, which frees the blocks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Generic, Protocol, TypeVar

import grpc

from canteen.v1 import common_pb2, scheduler_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
_FINAL = grpc.aio.Metadata(("canteen-final", "1"))


class Outbox:
    """What the gateway sends on a Connect stream, in order: submits and cancels queued
    while a write is under way go together in the next message (one write, one read for
    the scheduler, however many requests arrived meanwhile). ``close`` ends the stream."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[scheduler_pb2.SubmitRequest | int | None] = asyncio.Queue()

    def submit(self, submit: scheduler_pb2.SubmitRequest) -> None:
        self._queue.put_nowait(submit)

    def cancel(self, tag: int) -> None:
        self._queue.put_nowait(tag)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def messages(self) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
        queue = self._queue
        while (item := await queue.get()) is not None:
            msg = scheduler_pb2.ConnectRequest()
            while True:
                if isinstance(item, int):
                    msg.cancels.append(item)
                else:
                    msg.submits.append(item)
                if queue.empty():
                    break
                if (item := queue.get_nowait()) is None:
                    yield msg
                    return
            yield msg


def submit_message(
    request: scheduler_pb2.ScheduleRequest, tag: int, timeout: float | None, traceparent: str
) -> scheduler_pb2.SubmitRequest:
    request.subscription_id, request.stream_tag = "", tag
    return scheduler_pb2.SubmitRequest(
        request=request, timeout_seconds=timeout or 0.0, traceparent=traceparent
    )


def error_from_pb(error: scheduler_pb2.RequestError) -> grpc.aio.AioRpcError:
    """A request's failure entry as the error its own call would have raised."""
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    trailers = grpc.aio.Metadata() if error.retryable else _FINAL
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, error.message)


def deadline_exceeded() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "Deadline Exceeded",
    )


class Tokens:
    """A packed entry of a Connect batch: a request's new tokens and their logprobs, and
    nothing else. Read where a ``ScheduleResponse`` is (the same attribute names), without a
    message built for it."""

    __slots__ = ("logprobs", "token_ids")
    finish_reason = 0
    queue_seconds = 0.0
    top_logprobs: tuple[common_pb2.TopLogprobs, ...] = ()
    usage = None

    def __init__(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.token_ids, self.logprobs = token_ids, logprobs

    def then(self, more: Tokens | scheduler_pb2.ScheduleResponse) -> Response:
        """These tokens followed by ``more``'s (the entries of a request that fell behind)."""
        if isinstance(more, Tokens):
            self.token_ids += more.token_ids
            self.logprobs += more.logprobs
            return self
        merged = scheduler_pb2.ScheduleResponse(token_ids=self.token_ids, logprobs=self.logprobs)
        merged.MergeFrom(more)
        return merged


Response = scheduler_pb2.ScheduleResponse | Tokens


def unpack(batch: scheduler_pb2.ScheduleBatch) -> list[tuple[int, Tokens]]:
    """A batch's packed entries, in order, each as (tag, its tokens)."""
    tags = batch.packed_tags
    if not tags:
        return []
    ids, logprobs = list(batch.packed_token_ids), list(batch.packed_logprobs)
    entries = []
    start = 0
    for tag, num in zip(tags, batch.packed_num_tokens, strict=True):
        end = start + num
        entries.append((tag, Tokens(ids[start:end], logprobs[start:end])))
        start = end
    return entries


class Inbox(Generic[T]):
    """One request's items from the shared stream's reader, read by the request alone.
    An ``asyncio.Queue`` without what this path never uses (task accounting, bounds,
    several readers): a put and a get cost a message of every request at every step."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> T:
        """The oldest item; IndexError when there is none (check ``empty`` first)."""
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items


class Pending(Protocol[T_co]):
    """What ``gateway.upstream._caught_up`` reads of an inbox (an ``Inbox`` or a Queue)."""

    def empty(self) -> bool: ...
    def get_nowait(self) -> T_co: ...
