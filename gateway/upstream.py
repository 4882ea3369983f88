"""The gateway's calls to the scheduler, and each request's tokens.

By default (``--scheduler-stream shared``) the gateway holds one ``Connect`` stream to the
scheduler: requests go up it as messages and come back as tagged entries of one message per
step with every request's new tokens (gateway/upstream_connect.py). A scheduler without
Connect gets the older split (``--scheduler-stream subscribe``): one ``Subscribe`` stream
for the tokens and a Generate call per request that names it with a tag and carries only
the control (its deadline, trace context and identity, the gateway's cancel, and the
scheduler's verdict when it fails). Either way a step costs the scheduler one message and
one write per gateway instead of one per request.

Until a request's first token, a scheduler that cannot be reached (restarting, draining) is
retried with backoff for ``--scheduler-retry`` seconds within the deadline; once tokens have
flowed, a failure ends the stream and nothing is sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator
from typing import TypeAlias

import grpc

from canteen.local_socket import OPEN_TIMEOUT_S
from canteen.logging import get_logger
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from gateway.upstream_connect import (
    Inbox,
    Outbox,
    Pending,
    Response,
    Tokens,
    deadline_exceeded,
    error_from_pb,
    submit_message,
    unpack,
)
from gateway.upstream_local import LocalConnect

log = get_logger(__name__)

Metadata = tuple[tuple[str, str], ...]
# What a request's inbox receives: a response, its own call once done, or the shared
# stream's failure.
_Item: TypeAlias = "Response | grpc.aio.UnaryStreamCall | grpc.aio.AioRpcError"


class Feed:
    """One open Subscribe stream: routes each tagged response to its request's inbox."""

    def __init__(
        self,
        subscription_id: str,
        call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall | LocalConnect,
        outbox: Outbox | None = None,
    ) -> None:
        self.id, self.call = subscription_id, call
        self.outbox = outbox  # a Connect stream's: requests go up it
        self.is_stale = False  # the scheduler refused a request as draining: open anew
        self.inboxes: dict[int, Inbox[_Item]] = {}
        self.error: grpc.aio.AioRpcError | None = None
        self.reader: asyncio.Task[None] | None = None

    def attach(self, tag: int) -> Inbox[_Item]:
        """``tag``'s inbox; on a feed already broken it holds the break at once (a request
        that waited on the opening while the stream ended must retry, not wait)."""
        inbox: Inbox[_Item] = Inbox()
        if self.error is not None:
            inbox.put_nowait(self.error)
        else:
            self.inboxes[tag] = inbox
        return inbox

    def detach(self, tag: int) -> None:
        self.inboxes.pop(tag, None)

    async def read(self) -> None:
        try:
            # read(), not iteration: the opening read the first message with it
            while (batch := await self.call.read()) is not grpc.aio.EOF:
                for tag, tokens in unpack(batch):  # before the responses: see the proto
                    inbox = self.inboxes.get(tag)
                    if inbox is not None:
                        inbox.put_nowait(tokens)
                for response in batch.responses:
                    inbox = self.inboxes.get(response.stream_tag)
                    if inbox is not None:
                        inbox.put_nowait(response)
            error = _unavailable("the scheduler ended the shared token stream")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            self._fail(_unavailable("the gateway closed the shared token stream"))
            raise
        except Exception as exc:  # a bug here must fail the requests, not strand them
            log.exception("shared token stream reader failed")
            error = _unavailable(f"the shared token stream failed: {exc}")
        log.warning("shared token stream lost", code=error.code().name, details=error.details())
        self._fail(error)

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        """Every attached request fails with ``error``; the next request opens a new feed."""
        self.error = error
        for inbox in self.inboxes.values():
            inbox.put_nowait(error)
        self.inboxes.clear()


class SchedulerClient:
    """Runs requests on the scheduler, over the shared stream or each on its own."""

    def __init__(
        self,
        stub: scheduler_pb2_grpc.SchedulerStub,
        retry_seconds: float,
        shared: bool = True,
        connect: bool = False,
        local: bool = False,
    ) -> None:
        self._stub = stub
        self._retry_seconds = retry_seconds
        self.is_shared = shared
        self.is_connect = shared and connect  # requests on the stream too (else Subscribe)
        self.is_local = local  # Connect on the scheduler's local socket where it offers one
        self._feed: Feed | None = None
        self._opening: asyncio.Future[Feed] | None = None
        self._tags = itertools.count(1)

    async def stream(
        self, request: scheduler_pb2.ScheduleRequest, timeout: float | None, metadata: Metadata
    ) -> AsyncGenerator[Response]:
        """The scheduler's responses for ``request``, the last with finish_reason set."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._retry_seconds
        deadline = loop.time() + timeout if timeout is not None else None
        delay = 0.05
        while True:
            remaining = deadline - loop.time() if deadline is not None else None
            received = False
            try:
                responses = await self._once(request, remaining, metadata)
                async with contextlib.aclosing(responses):
                    async for msg in responses:
                        received = True
                        yield msg
                return
            except grpc.aio.AioRpcError as exc:
                last_try = min(give_up, deadline or give_up) < loop.time() + delay
                if received or last_try or not _unreachable(exc):
                    raise
                log.warning("scheduler unreachable; retrying", code=exc.code().name, delay=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        if self._feed is not None and self._feed.reader is not None:
            self._feed.reader.cancel()
            self._feed.call.cancel()
            if self._feed.outbox is not None:
                self._feed.outbox.close()

    async def _once(
        self, request: scheduler_pb2.ScheduleRequest, timeout: float | None, metadata: Metadata
    ) -> AsyncGenerator[Response]:
        if not self.is_shared:
            return self._own(request, timeout, metadata)
        feed = await self._open_feed(timeout)
        if feed is None:  # the scheduler has no Subscribe: each request on its own stream
            return self._own(request, timeout, metadata)
        if feed.outbox is not None:
            return self._connected(feed, feed.outbox, request, timeout, metadata)
        return self._shared(feed, request, timeout, metadata)

    async def _connected(
        self,
        feed: Feed,
        outbox: Outbox,
        request: scheduler_pb2.ScheduleRequest,
        timeout: float | None,
        metadata: Metadata,
    ) -> AsyncGenerator[Response]:
        """One request as a message on the Connect stream (gateway/upstream_connect.py)."""
        tag = next(self._tags)
        inbox = feed.attach(tag)
        traceparent = next((v for k, v in metadata if k == "traceparent"), "")
        outbox.submit(submit_message(request, tag, timeout, traceparent))
        timer = None
        if timeout is not None:  # a call's deadline would end it so: the same error
            timer = asyncio.get_running_loop().call_later(
                timeout, inbox.put_nowait, deadline_exceeded()
            )
        is_over = False
        pending: _Item | None = None
        try:
            while True:
                item = pending if pending is not None else await inbox.get()
                pending = None
                if isinstance(item, grpc.aio.AioRpcError):  # the stream broke, or the deadline
                    is_over = item.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                    raise item
                if isinstance(item, scheduler_pb2.ScheduleResponse):
                    if item.HasField("failure"):
                        is_over = True
                        # A draining scheduler: the retry goes on a new stream (to its
                        # successor), while this one serves its running requests out.
                        feed.is_stale = feed.is_stale or item.failure.retryable
                        raise error_from_pb(item.failure)
                elif not isinstance(item, Tokens):
                    continue  # (a Generate call's end: none on this path)
                item, pending = _caught_up(item, inbox)
                yield item
                if item.finish_reason:
                    is_over = True
                    return
        finally:
            feed.detach(tag)
            if timer is not None:
                timer.cancel()
            if not is_over and feed.error is None:
                outbox.cancel(tag)

    async def _own(
        self, request: scheduler_pb2.ScheduleRequest, timeout: float | None, metadata: Metadata
    ) -> AsyncGenerator[Response]:
        request.subscription_id, request.stream_tag = "", 0
        call = self._stub.Generate(request, timeout=timeout, metadata=metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def _shared(
        self,
        feed: Feed,
        request: scheduler_pb2.ScheduleRequest,
        timeout: float | None,
        metadata: Metadata,
    ) -> AsyncGenerator[Response]:
        tag = next(self._tags)
        inbox = feed.attach(tag)
        request.subscription_id, request.stream_tag = feed.id, tag
        call = self._stub.Generate(request, timeout=timeout, metadata=metadata)
        call.add_done_callback(inbox.put_nowait)
        pending: _Item | None = None
        try:
            while True:
                item = pending if pending is not None else await inbox.get()
                pending = None
                if isinstance(item, scheduler_pb2.ScheduleResponse):
                    item, pending = _caught_up(item, inbox)
                    yield item
                    if item.finish_reason:
                        return
                elif isinstance(item, grpc.aio.AioRpcError):
                    raise item  # the shared stream broke
                elif (error := await _error_of(item)) is not None:
                    if not _refused(error):
                        raise error
                    # Not this scheduler's subscription (a balancer between us): own stream.
                    log.warning("subscription refused; own stream", details=error.details())
                    async with contextlib.aclosing(self._own(request, timeout, metadata)) as own:
                        async for msg in own:
                            yield msg
                    return
                # The call ended OK: the final message is on its way on the shared stream.
        finally:
            feed.detach(tag)
            call.cancel()

    async def _open_feed(self, timeout: float | None) -> Feed | None:
        """The open feed, opened on first use and after a break (one opening at a time,
        waited for at most ``timeout``); None when the scheduler does not serve Subscribe."""
        if self._feed is not None and self._feed.error is None and not self._feed.is_stale:
            return self._feed
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(_retrieve)
        try:
            self._feed = await asyncio.wait_for(asyncio.shield(self._opening), timeout)
        except TimeoutError:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded (opening the shared token stream)",
            ) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.warning("the scheduler has no Subscribe; each request on its own stream")
            self.is_shared = False
            return None
        return self._feed

    async def _open(self) -> Feed:
        if self.is_connect:
            try:
                return await self._open_connect()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.warning("the scheduler has no Connect; requests as Generate calls")
                self.is_connect = False
        call = self._stub.Subscribe(scheduler_pb2.SubscribeRequest())
        first = await call.read()
        if first is grpc.aio.EOF:
            raise await _error_of(call) or _unavailable("the scheduler ended Subscribe at once")
        return self._start(Feed(first.subscription_id, call))

    async def _open_connect(self) -> Feed:
        outbox = Outbox()
        call = self._stub.Connect(outbox.messages())
        first = await call.read()
        if first is grpc.aio.EOF:
            raise await _error_of(call) or _unavailable("the scheduler ended Connect at once")
        if first.local_socket and self.is_local:
            feed = await self._open_local(first.local_socket)
            if feed is not None:
                outbox.close()
                call.cancel()
                return feed
        return self._start(Feed(first.subscription_id, call, outbox))

    async def _open_local(self, path: str) -> Feed | None:
        """The shared stream on the scheduler's local socket (gateway/upstream_local.py);
        None where this gateway cannot reach it (it stays on gRPC)."""
        outbox = Outbox()
        local = await LocalConnect.open(path, outbox)
        if local is None:
            return None
        try:
            first = await asyncio.wait_for(local.read(), OPEN_TIMEOUT_S)
        except TimeoutError:
            log.warning("the scheduler's local stream sent nothing; staying on gRPC", path=path)
            local.cancel()
            return None
        if not isinstance(first, scheduler_pb2.ScheduleBatch):
            local.cancel()
            raise _unavailable("the scheduler ended its local stream at once")
        log.info("shared token stream on the scheduler's local socket")
        return self._start(Feed(first.subscription_id, local, outbox))

    def _start(self, feed: Feed) -> Feed:
        feed.reader = asyncio.ensure_future(feed.read())
        log.info("shared token stream open")
        return feed


def _caught_up(response: Response, inbox: Pending[_Item]) -> tuple[Response, _Item | None]:
    """``response`` and the responses queued behind it as one message, and the first other
    item met on the way, kept for after it. A request that fell behind the steps (its
    caller reads slower than the worker makes tokens) then costs one message downstream,
    not one per step: the tokens, logprobs and alternatives of each in order, the queue time
    of the first (later ones do not carry it), the finish and usage of the last."""
    while not response.finish_reason and not inbox.empty():
        more = inbox.get_nowait()
        if isinstance(more, Tokens) or (
            isinstance(more, scheduler_pb2.ScheduleResponse) and not more.HasField("failure")
        ):
            response = _merged(response, more)
        else:
            return response, more
    return response, None


def _merged(response: Response, more: Response) -> Response:
    if isinstance(response, Tokens):
        return response.then(more)
    if isinstance(more, Tokens):
        response.token_ids.extend(more.token_ids)
        response.logprobs.extend(more.logprobs)
    else:
        response.MergeFrom(more)
    return response


async def _error_of(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError | None:
    """The error a finished call ended with; None when it ended OK."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return None
    return grpc.aio.AioRpcError(
        code,
        await call.initial_metadata(),
        await call.trailing_metadata(),
        await call.details(),
    )


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


def _retrieve(future: asyncio.Future[Feed]) -> None:
    """Marks an opening's failure as seen (every waiter gets it; none may be left)."""
    if not future.cancelled():
        future.exception()


def _refused(exc: grpc.aio.AioRpcError) -> bool:
    return any(key == "canteen-subscription" for key, _ in exc.trailing_metadata() or ())


def _unreachable(exc: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE from the transport or a draining server, or CANCELLED by a server that
    was stopping as the call arrived; not the scheduler's own verdict (those carry
    ``canteen-final`` in their trailers). The gateway's own cancel never lands here."""
    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return False
    return not any(key == "canteen-final" for key, _ in exc.trailing_metadata() or ())
