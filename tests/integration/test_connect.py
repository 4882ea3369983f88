"""Requests multiplexed on one stream (Scheduler.Connect), on the real suite: requests sent
as messages get exactly their tokens, a cancel frees the blocks and leaves the others alone,
and a request's failure comes back as its own entry with the status and message a Generate
call would have ended with."""

from __future__ import annotations

import queue
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc

from canteen.v1 import common_pb2, scheduler_pb2
from gateway.upstream_connect import unpack
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite
from tests.integration.test_shared_stream import PROMPTS, _num_held, _request
from tests.support import reference
from tests.support.streams import until


class Sender:
    """The client's side of a Connect stream: messages sent one by one, as a gateway does."""

    def __init__(self) -> None:
        self._queue: queue.Queue[scheduler_pb2.ConnectRequest | None] = queue.Queue()

    def submit(self, tag: int, request: scheduler_pb2.ScheduleRequest, timeout: float = 0) -> None:
        request.stream_tag = tag
        submit = scheduler_pb2.SubmitRequest(request=request, timeout_seconds=timeout)
        self._queue.put(scheduler_pb2.ConnectRequest(submits=[submit]))

    def send(self, msg: scheduler_pb2.ConnectRequest) -> None:
        self._queue.put(msg)

    def cancel(self, tag: int) -> None:
        self._queue.put(scheduler_pb2.ConnectRequest(cancels=[tag]))

    def messages(self) -> Iterator[scheduler_pb2.ConnectRequest]:
        while (msg := self._queue.get()) is not None:
            yield msg

    def close(self) -> None:
        self._queue.put(None)


def _entries(batch: scheduler_pb2.ScheduleBatch) -> list[scheduler_pb2.ScheduleResponse]:
    """A batch's entries in order, the packed ones first, each as a response."""
    packed = [
        scheduler_pb2.ScheduleResponse(stream_tag=tag, token_ids=t.token_ids, logprobs=t.logprobs)
        for tag, t in unpack(batch)
    ]
    return [*packed, *batch.responses]


def _collect(
    feed: Iterator[scheduler_pb2.ScheduleBatch], tags: set[int]
) -> tuple[dict[int, list[scheduler_pb2.ScheduleResponse]], list[int], int]:
    """Reads ``feed`` until every tag's last entry: each tag's entries, how many entries
    each message carried, and how many of them came packed."""
    got: dict[int, list[scheduler_pb2.ScheduleResponse]] = defaultdict(list)
    sizes, open_tags, num_packed = [], set(tags), 0
    while open_tags:
        batch = next(feed)
        entries = _entries(batch)
        sizes.append(len(entries))
        num_packed += len(batch.packed_tags)
        for response in entries:
            got[response.stream_tag].append(response)
            if response.finish_reason or response.HasField("failure"):
                open_tags.discard(response.stream_tag)
    return got, sizes, num_packed


def _connect(suite: TinySuite) -> tuple[Sender, Iterator[scheduler_pb2.ScheduleBatch], grpc.Call]:
    sender = Sender()
    call = suite.scheduler_stub.Connect(sender.messages(), timeout=120)
    first = next(call)
    assert len(first.subscription_id) == 32 and not first.responses
    return sender, call, call


def _pool_free(suite: TinySuite) -> bool:
    stats = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).workers[0]
    return bool(stats.num_running == 0 and stats.num_free_blocks == NUM_KV_BLOCKS)


def test_requests_sent_as_messages_get_exactly_their_tokens(
    suite: TinySuite, tiny_model_dir: Path
) -> None:
    sender, feed, call = _connect(suite)
    tags = {100 + i: prompt for i, prompt in enumerate(PROMPTS)}
    # The worker pauses while the requests arrive, so that they run in the same steps.
    suite.worker.process.send_signal(signal.SIGSTOP)
    try:
        sender.send(  # several requests in one message, as a gateway's outbox sends them
            scheduler_pb2.ConnectRequest(
                submits=[
                    scheduler_pb2.SubmitRequest(request=_request(p, 16, stream_tag=t))
                    for t, p in tags.items()
                ]
            )
        )
        until(lambda: _num_held(suite.scheduler_stub) == len(tags), 20, "every request")
    finally:
        suite.worker.process.send_signal(signal.SIGCONT)
    got, sizes, num_packed = _collect(feed, set(tags))
    call.cancel()
    for tag, prompt in tags.items():
        responses = got[tag]
        assert [t for r in responses for t in r.token_ids] == reference.greedy(
            tiny_model_dir, prompt, 16
        )
        assert sum(len(r.logprobs) for r in responses) == 16
        last = responses[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 16)
        assert responses[0].queue_seconds > 0
        assert not any(r.HasField("failure") for r in responses)
    assert max(sizes) == len(tags) and len(sizes) < sum(sizes)
    # A step's entries with tokens and nothing else travel packed: all but each request's
    # first and last entries.
    assert num_packed == sum(len(got[tag]) - 2 for tag in tags) > 0


def test_a_cancel_frees_its_blocks_and_the_other_request_goes_on(
    suite: TinySuite, tiny_model_dir: Path
) -> None:
    sender, feed, call = _connect(suite)
    sender.submit(1, _request([5, 6, 7], 400))
    sender.submit(2, _request([8, 9], 40))
    got: dict[int, list[scheduler_pb2.ScheduleResponse]] = {1: [], 2: []}
    while not got[1]:
        for r in _entries(next(feed)):
            got[r.stream_tag].append(r)
    sender.cancel(1)
    rest, _, _ = _collect(feed, {2})
    got[2].extend(rest[2])
    assert [t for r in got[2] for t in r.token_ids] == reference.greedy(tiny_model_dir, [8, 9], 40)
    assert not any(r.finish_reason for r in got[1] + rest[1])  # no end for a cancel
    until(lambda: _pool_free(suite), 30, "every block back in the pool")
    call.cancel()


def test_a_failed_request_gets_its_status_and_the_others_go_on(
    suite: TinySuite, tiny_model_dir: Path
) -> None:
    sender, feed, call = _connect(suite)
    sender.submit(1, _request([5, 1_000_000], 4))
    sender.submit(2, _request([5, 6], 4, stream_interval=99))
    # a deadline far shorter than its work (700 tokens): a quiet host made 400 in 0.5 s
    sender.submit(3, _request([5, 6, 7], 700), timeout=0.05)
    sender.submit(4, _request([8, 9], 8))
    ends: dict[int, scheduler_pb2.ScheduleResponse] = {}
    tokens: list[int] = []
    while len(ends) < 4:
        for r in _entries(next(feed)):
            if r.stream_tag == 4:
                tokens.extend(r.token_ids)
            if r.finish_reason or r.HasField("failure"):
                ends[r.stream_tag] = r
    call.cancel()
    assert ends[1].failure.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert ends[1].failure.message.startswith(
        "prompt_token_ids: token id 1000000 is outside the model's vocabulary of "
    )
    assert (ends[2].failure.code, ends[2].failure.message) == (
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        "stream_interval=99: must be in 0..64",
    )
    assert (ends[3].failure.code, ends[3].failure.message) == (
        grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
        "Deadline Exceeded",
    )
    assert not any(ends[t].failure.retryable for t in (1, 2, 3))
    assert tokens == reference.greedy(tiny_model_dir, [8, 9], 8)
    assert ends[4].finish_reason == common_pb2.FINISH_REASON_LENGTH
    until(lambda: _pool_free(suite), 30, "every block back in the pool")
