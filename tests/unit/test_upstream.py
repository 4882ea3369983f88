"""The gateway's scheduler client against a scripted scheduler on loopback (real gRPC): the
shared token stream, its fallbacks, and the retry-before-first-token rule on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from canteen.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from gateway.upstream import SchedulerClient
from gateway.upstream_connect import Response

TOKENS = [7, 8, 9]


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Answers every request with TOKENS; ``mode`` picks how the shared stream behaves."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.feeds: dict[str, asyncio.Queue[scheduler_pb2.ScheduleBatch | None]] = {}
        self.requests: list[scheduler_pb2.ScheduleRequest] = []
        self.cancelled = asyncio.Event()

    async def Subscribe(
        self, request: scheduler_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.ScheduleBatch]:
        if self.mode == "no-subscribe":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        queue: asyncio.Queue[scheduler_pb2.ScheduleBatch | None] = asyncio.Queue()
        sub = f"sub-{len(self.feeds)}"
        self.feeds[sub] = queue
        yield scheduler_pb2.ScheduleBatch(subscription_id=sub)
        while (batch := await queue.get()) is not None:
            yield batch
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the feed broke")

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetStatsResponse:
        return scheduler_pb2.GetStatsResponse()

    async def Connect(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ScheduleBatch]:
        # A scheduler from before Connect: requests go as Generate calls.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield scheduler_pb2.ScheduleBatch()

    async def Generate(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.ScheduleResponse]:
        self.requests.append(scheduler_pb2.ScheduleRequest.FromString(request.SerializeToString()))
        responses = [
            scheduler_pb2.ScheduleResponse(token_ids=[t], logprobs=[-t / 10]) for t in TOKENS
        ]
        responses[0].queue_seconds = 0.25
        responses[-1].finish_reason = common_pb2.FINISH_REASON_LENGTH
        responses[-1].usage.completion_tokens = len(TOKENS)
        if not request.subscription_id:
            for response in responses:
                yield response
            return
        feed, tag, mode = self.feeds[request.subscription_id], request.stream_tag, self.mode
        if mode == "refuse":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "not open here",
                (("canteen-final", "1"), ("canteen-subscription", "refused")),
            )
        if mode == "verdict":
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "worker lost", (("canteen-final", "1"),)
            )
        if mode in ("break-first", "break-after"):
            self.mode = "ok"  # the next feed works
            if mode == "break-after":
                feed.put_nowait(_tagged(responses[0], tag))
            feed.put_nowait(None)
            await asyncio.sleep(30)
        if mode == "hold":
            feed.put_nowait(_tagged(responses[0], tag))
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

        # The call ends OK before its tokens are on the shared stream: the client waits.
        def send() -> None:
            for response in responses:
                feed.put_nowait(_tagged(response, tag))

        asyncio.get_running_loop().call_later(0.05, send)
        return
        yield


def _tagged(response: scheduler_pb2.ScheduleResponse, tag: int) -> scheduler_pb2.ScheduleBatch:
    tagged = scheduler_pb2.ScheduleResponse()
    tagged.CopyFrom(response)
    tagged.stream_tag = tag
    return scheduler_pb2.ScheduleBatch(responses=[tagged])


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedScheduler, SchedulerClient]]:
    fake = ScriptedScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = SchedulerClient(scheduler_pb2_grpc.SchedulerStub(channel), retry_seconds=5)
    yield fake, client
    await client.close()
    await channel.close()
    await server.stop(0)


async def _tokens(client: SchedulerClient, timeout: float = 10) -> list[int]:
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="m", max_tokens=3)
    got: list[int] = []
    async for msg in client.stream(request, timeout, ()):
        got.extend(msg.token_ids)
        if msg.finish_reason:
            assert isinstance(msg, scheduler_pb2.ScheduleResponse)  # a last entry is one
            assert msg.usage.completion_tokens == len(got)
    return got


async def test_tokens_come_on_the_shared_stream_even_after_the_call_ended(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    assert await asyncio.gather(*(_tokens(client) for _ in range(4))) == [TOKENS] * 4
    assert len(fake.feeds) == 1  # one stream for all of them
    assert sorted(r.stream_tag for r in fake.requests) == [1, 2, 3, 4]
    assert {r.subscription_id for r in fake.requests} == {"sub-0"}


async def test_a_refused_subscription_runs_the_request_on_its_own_stream(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    fake.mode = "refuse"
    assert await _tokens(client) == TOKENS
    assert [(r.subscription_id, r.stream_tag) for r in fake.requests] == [("sub-0", 1), ("", 0)]


async def test_a_scheduler_without_subscribe_gets_one_stream_per_request(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    fake.mode = "no-subscribe"
    assert await _tokens(client) == TOKENS
    assert await _tokens(client) == TOKENS
    assert not client.is_shared
    assert [r.subscription_id for r in fake.requests] == ["", ""]


async def test_a_feed_lost_before_the_first_token_is_retried_on_a_new_one(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    fake.mode = "break-first"
    assert await _tokens(client) == TOKENS
    assert list(fake.feeds) == ["sub-0", "sub-1"]
    assert [r.subscription_id for r in fake.requests] == ["sub-0", "sub-1"]


async def test_a_feed_lost_after_a_token_fails_the_request_without_a_retry(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    fake.mode = "break-after"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _tokens(client)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "the feed broke"
    assert len(fake.requests) == 1
    assert await _tokens(client) == TOKENS  # the next request opens a new feed


async def test_the_scheduler_s_verdict_ends_the_request_as_it_came(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    fake.mode = "verdict"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _tokens(client)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "worker lost")
    assert len(fake.requests) == 1  # final: not retried


async def test_a_caller_that_leaves_cancels_the_request_upstream(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    fake, client = scripted
    fake.mode = "hold"
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="m", max_tokens=3)
    responses = client.stream(request, 10, ())
    async with contextlib.aclosing(responses):
        async for msg in responses:
            assert list(msg.token_ids) == TOKENS[:1]
            break
    await asyncio.wait_for(fake.cancelled.wait(), 5)


async def test_a_caller_behind_the_steps_gets_the_tokens_it_missed_in_one_message(
    scripted: tuple[ScriptedScheduler, SchedulerClient],
) -> None:
    _, client = scripted
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="m", max_tokens=3)
    got: list[Response] = []
    async for msg in client.stream(request, 10, ()):
        got.append(msg)
        await asyncio.sleep(0.3)  # every later token arrives meanwhile
    # one message per step would be three; a slow reader gets what it missed at once
    assert 1 <= len(got) <= 2
    assert [t for m in got for t in m.token_ids] == TOKENS
    assert [round(lp, 3) for m in got for lp in m.logprobs] == [-0.7, -0.8, -0.9]
    assert got[0].queue_seconds == 0.25
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert isinstance(got[-1], scheduler_pb2.ScheduleResponse)  # a last entry is one
    assert got[-1].usage.completion_tokens == 3
