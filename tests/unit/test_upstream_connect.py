"""The gateway's Connect client against a scripted scheduler: requests go up the one stream
as messages, a failure entry is raised as the status its own call would have ended with, a
deadline ends the request and cancels it upstream, and a scheduler without Connect gets
Generate calls on the Subscribe stream instead."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from canteen.local_socket import SCHEDULER_NAME, LocalServer
from canteen.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from gateway.upstream import SchedulerClient
from tests.unit.test_upstream import TOKENS, ScriptedScheduler


class ConnectScheduler(ScriptedScheduler):
    """Answers each submit with TOKENS on the stream, or as ``mode`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[scheduler_pb2.ConnectRequest] = []
        self.received: list[scheduler_pb2.SubmitRequest] = []
        self.cancels: list[int] = []
        self.num_streams = 0
        self.got_cancel = asyncio.Event()
        self.local_socket = ""  # named in the first batch, as a scheduler with one does

    async def Connect(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ScheduleBatch]:
        self.num_streams += 1
        if self.mode == "end":  # a scheduler stopping as the stream opened
            self.mode = "ok"  # the next stream works
            yield scheduler_pb2.ScheduleBatch(subscription_id="ending")
            return
        out: asyncio.Queue[scheduler_pb2.ScheduleBatch] = asyncio.Queue()
        reader = asyncio.create_task(self._read(request_iterator, out))
        try:
            yield scheduler_pb2.ScheduleBatch(
                subscription_id="conn", local_socket=self.local_socket
            )
            while True:
                yield await out.get()
        finally:
            reader.cancel()

    async def _read(
        self,
        requests: AsyncIterator[scheduler_pb2.ConnectRequest],
        out: asyncio.Queue[scheduler_pb2.ScheduleBatch],
    ) -> None:
        async for msg in requests:
            self.messages.append(msg)
            self.cancels.extend(msg.cancels)
            if msg.cancels:
                self.got_cancel.set()
            for submit in msg.submits:
                self.received.append(submit)
                out.put_nowait(self._answer(submit.request.stream_tag))

    def _answer(self, tag: int) -> scheduler_pb2.ScheduleBatch:
        batch = scheduler_pb2.ScheduleBatch()
        if self.mode == "draining":
            self.mode = "ok"  # the next stream works
            failure = scheduler_pb2.RequestError(
                code=14, message="server is shutting down; retry elsewhere", retryable=True
            )
            batch.responses.add(stream_tag=tag, failure=failure)
        elif self.mode == "verdict":
            failure = scheduler_pb2.RequestError(code=8, message="the waiting queue is full")
            batch.responses.add(stream_tag=tag, failure=failure)
        elif self.mode != "hold":
            for i, token in enumerate(TOKENS):
                entry = batch.responses.add(stream_tag=tag, token_ids=[token])
                if i == len(TOKENS) - 1:
                    entry.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    entry.usage.completion_tokens = len(TOKENS)
        return batch


@pytest.fixture
async def connected() -> AsyncIterator[tuple[ConnectScheduler, SchedulerClient]]:
    fake = ConnectScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    client = SchedulerClient(stub, retry_seconds=5, connect=True)
    yield fake, client
    await client.close()
    await channel.close()
    await server.stop(0)


async def _tokens(client: SchedulerClient, timeout: float = 10) -> list[int]:
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="m", max_tokens=3)
    got: list[int] = []
    metadata = (("x-request-id", "r"), ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"))
    async for msg in client.stream(request, timeout, metadata):
        got.extend(msg.token_ids)
    return got


async def test_requests_go_up_the_one_stream_and_get_their_tokens(
    connected: tuple[ConnectScheduler, SchedulerClient],
) -> None:
    fake, client = connected
    assert await asyncio.gather(*(_tokens(client) for _ in range(4))) == [TOKENS] * 4
    assert fake.num_streams == 1 and fake.requests == []  # no Generate call at all
    assert sorted(m.request.stream_tag for m in fake.received) == [1, 2, 3, 4]
    assert {m.traceparent for m in fake.received} == {"00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    assert all(9 < m.timeout_seconds <= 10 for m in fake.received)


async def test_a_failure_entry_is_the_scheduler_s_final_verdict(
    connected: tuple[ConnectScheduler, SchedulerClient],
) -> None:
    fake, client = connected
    fake.mode = "verdict"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _tokens(client)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "the waiting queue is full",
    )
    assert len(fake.received) == 1  # final: not retried
    assert not fake.got_cancel.is_set()


async def test_a_request_refused_by_a_draining_scheduler_is_retried_on_a_new_stream(
    connected: tuple[ConnectScheduler, SchedulerClient],
) -> None:
    fake, client = connected
    fake.mode = "draining"
    assert await _tokens(client) == TOKENS
    assert fake.num_streams == 2
    assert [m.request.stream_tag for m in fake.received] == [1, 2]


async def test_requests_waiting_on_a_stream_that_ends_as_it_opens_are_retried_not_stranded(
    connected: tuple[ConnectScheduler, SchedulerClient],
) -> None:
    """The stream ends before the requests that waited on its opening join it: each must
    see the break and retry on a new stream, not wait for tokens until its deadline."""
    fake, client = connected
    fake.mode = "end"
    got = await asyncio.wait_for(asyncio.gather(*(_tokens(client) for _ in range(4))), 8)
    assert got == [TOKENS] * 4
    assert fake.num_streams == 2
    assert len(fake.received) == 4  # every request went up the second stream once


async def test_a_local_socket_that_says_hello_and_then_nothing_leaves_the_stream_on_grpc(
    connected: tuple[ConnectScheduler, SchedulerClient],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduler's socket answers the hello but never the stream's first batch (a
    scheduler stuck as it stops): the gateway gives up on it within the open timeout and
    serves the requests on the gRPC stream, none waiting for its deadline."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fake, client = connected
    client.is_local = True

    async def silent(payloads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for payload in payloads:  # nothing comes up before the first batch: it
            yield payload  # waits, and ends when the gateway hangs up

    server = LocalServer("canteen-test-", SCHEDULER_NAME, silent)
    fake.local_socket = await server.start()
    try:
        got = await asyncio.wait_for(asyncio.gather(*(_tokens(client) for _ in range(3))), 8)
    finally:
        server.close()
    assert got == [TOKENS] * 3
    assert fake.num_streams == 1 and len(fake.received) == 3  # all on the gRPC stream


async def test_a_deadline_ends_the_request_and_cancels_it_upstream(
    connected: tuple[ConnectScheduler, SchedulerClient],
) -> None:
    fake, client = connected
    fake.mode = "hold"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _tokens(client, timeout=0.3)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "Deadline Exceeded",
    )
    await asyncio.wait_for(fake.got_cancel.wait(), 5)
    assert fake.cancels == [fake.received[0].request.stream_tag]


async def test_a_scheduler_without_connect_gets_generate_calls_on_subscribe() -> None:
    fake = ScriptedScheduler()  # its Connect answers UNIMPLEMENTED
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        client = SchedulerClient(stub, retry_seconds=5, connect=True)
        assert await _tokens(client) == TOKENS
        assert not client.is_connect and client.is_shared
        assert [r.subscription_id for r in fake.requests] == ["sub-0"]
        await client.close()
    await server.stop(0)


def test_a_step_s_plain_entries_travel_packed_and_read_back_in_order() -> None:
    from canteen.codec import batch_to_pb
    from canteen.finish import Finish
    from gateway.upstream_connect import unpack
    from scheduler.sequence import SeqEvent

    entries = [
        (1, SeqEvent("a", (10, 11), (-0.1, -0.2)), False),
        (2, SeqEvent("b", (20,), (-0.3,), queue_seconds=0.5), True),  # a first entry
        (3, SeqEvent("c", (30,), (-0.4,), finish=Finish.LENGTH), False),  # a last one
        (4, SeqEvent("d", (40, 41, 42), (-0.5, -0.6, -0.7)), False),
    ]
    batch = scheduler_pb2.ScheduleBatch.FromString(
        batch_to_pb(entries, packed=True).SerializeToString()
    )
    got = [(tag, t.token_ids, [round(p, 3) for p in t.logprobs]) for tag, t in unpack(batch)]
    assert got == [(1, [10, 11], [-0.1, -0.2]), (4, [40, 41, 42], [-0.5, -0.6, -0.7])]
    assert [(r.stream_tag, list(r.token_ids)) for r in batch.responses] == [(2, [20]), (3, [30])]
    assert batch.responses[0].queue_seconds == 0.5
    assert batch.responses[1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    unpacked = batch_to_pb(entries)  # a Subscribe stream's: every entry a message
    assert not unpacked.packed_tags and len(unpacked.responses) == 4


async def test_packed_entries_of_a_request_that_fell_behind_merge_into_one() -> None:
    from gateway.upstream import _caught_up
    from gateway.upstream_connect import Tokens

    inbox: asyncio.Queue[object] = asyncio.Queue()
    last = scheduler_pb2.ScheduleResponse(
        token_ids=[3], logprobs=[-3.0], finish_reason=common_pb2.FINISH_REASON_LENGTH
    )
    for item in (Tokens([2], [-2.0]), last, Tokens([9], [-9.0])):
        inbox.put_nowait(item)
    merged, pending = _caught_up(Tokens([1], [-1.0]), inbox)
    assert isinstance(merged, scheduler_pb2.ScheduleResponse)
    assert (list(merged.token_ids), list(merged.logprobs)) == ([1, 2, 3], [-1.0, -2.0, -3.0])
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert pending is None and inbox.qsize() == 1  # nothing read past the last entry


async def test_what_queues_during_a_write_goes_up_in_one_message() -> None:
    from gateway.upstream_connect import Outbox, submit_message

    outbox = Outbox()
    for tag in (1, 2, 3):
        outbox.submit(submit_message(scheduler_pb2.ScheduleRequest(), tag, None, ""))
    outbox.cancel(2)
    messages = outbox.messages()
    first = await anext(messages)
    assert [s.request.stream_tag for s in first.submits] == [1, 2, 3]
    assert list(first.cancels) == [2]
    outbox.submit(submit_message(scheduler_pb2.ScheduleRequest(), 4, 2.5, "tp"))
    outbox.close()
    second = await anext(messages)
    assert [(s.request.stream_tag, s.timeout_seconds, s.traceparent) for s in second.submits] == [
        (4, 2.5, "tp")
    ]
    assert [m async for m in messages] == []  # closed: the stream ends
