"""The scheduler's shared token stream (Scheduler.Subscribe), on the real suite: every
request's tokens on one stream, tagged, one message per step; the refusals; and the cancel
when the stream goes away."""

from __future__ import annotations

import concurrent.futures
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import common_pb2, inference_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite
from tests.support import reference
from tests.support.streams import until

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34]]


def _request(prompt: list[int], max_tokens: int, **fields: object) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(
        request_id="shared",
        model="tiny",
        version="v1",
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0, top_p=1),
        **fields,  # type: ignore[arg-type]
    )


def _num_held(stub: scheduler_pb2_grpc.SchedulerStub) -> int:
    """Requests the scheduler holds: running or waiting, on any worker."""
    stats = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    return sum(w.num_running + w.num_waiting for w in stats.workers)


def _collect(
    feed: Iterator[scheduler_pb2.ScheduleBatch], tags: set[int]
) -> tuple[dict[int, list[scheduler_pb2.ScheduleResponse]], list[int]]:
    """Reads ``feed`` until every tag's final message: each tag's responses, and how many
    entries each message carried."""
    got: dict[int, list[scheduler_pb2.ScheduleResponse]] = defaultdict(list)
    sizes, open_tags = [], set(tags)
    while open_tags:
        batch = next(feed)
        sizes.append(len(batch.responses))
        for response in batch.responses:
            got[response.stream_tag].append(response)
            if response.finish_reason:
                open_tags.discard(response.stream_tag)
    return got, sizes


def test_every_request_s_tokens_ride_one_stream_equal_to_its_own_stream(
    suite: TinySuite, tiny_model_dir: Path
) -> None:
    stub = suite.scheduler_stub
    feed = stub.Subscribe(scheduler_pb2.SubscribeRequest(), timeout=120)
    first = next(feed)
    assert len(first.subscription_id) == 32 and not first.responses
    tags = {100 + i: prompt for i, prompt in enumerate(PROMPTS)}
    with concurrent.futures.ThreadPoolExecutor(len(tags)) as pool:
        # The worker pauses while the requests arrive, so that they all run in the same steps
        # however the threads that send them are scheduled on a busy host.
        suite.worker.process.send_signal(signal.SIGSTOP)
        try:
            own = [
                pool.submit(
                    lambda t, p: list(
                        stub.Generate(
                            _request(p, 16, subscription_id=first.subscription_id, stream_tag=t),
                            timeout=60,
                        )
                    ),
                    tag,
                    prompt,
                )
                for tag, prompt in tags.items()
            ]
            until(lambda: _num_held(stub) == len(tags), 20, "every request to arrive")
        finally:
            suite.worker.process.send_signal(signal.SIGCONT)
        got, sizes = _collect(feed, set(tags))
        # A request's own stream carries nothing and ends OK.
        assert [call.result() for call in own] == [[]] * len(tags)
    feed.cancel()
    for tag, prompt in tags.items():
        responses = got[tag]
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == reference.greedy(tiny_model_dir, prompt, 16), tag
        assert [t for r in responses for t in r.token_ids] == [
            t for r in stub.Generate(_request(prompt, 16), timeout=60) for t in r.token_ids
        ]
        assert sum(len(r.logprobs) for r in responses) == 16
        last = responses[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 16)
        assert responses[0].queue_seconds > 0
        assert all(r.finish_reason == 0 for r in responses[:-1])
    # One message a step for every request: fewer messages than requests' entries in them.
    assert max(sizes) == len(tags) and len(sizes) < sum(sizes)


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        (
            {"subscription_id": "0" * 32, "stream_tag": 1},
            grpc.StatusCode.FAILED_PRECONDITION,
            f"subscription_id {'0' * 32!r} is not open on this scheduler",
        ),
        (
            {"subscription_id": "0" * 32},
            grpc.StatusCode.INVALID_ARGUMENT,
            "stream_tag is required with subscription_id",
        ),
        ({"stream_tag": 7}, grpc.StatusCode.INVALID_ARGUMENT, "stream_tag needs subscription_id"),
    ],
)
def test_a_request_naming_no_open_subscription_is_refused(
    suite: TinySuite, fields: dict[str, object], code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(suite.scheduler_stub.Generate(_request([5, 6], 2, **fields), timeout=10))
    assert info.value.code() == code
    assert info.value.details() == message
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # the gateway's cue to use its own stream
        trailers = dict(info.value.trailing_metadata() or ())
        assert trailers["canteen-subscription"] == "refused"


def test_only_calls_on_the_connection_that_opened_it_may_attach(suite: TinySuite) -> None:
    feed = suite.scheduler_stub.Subscribe(scheduler_pb2.SubscribeRequest(), timeout=60)
    sub = next(feed).subscription_id
    # A channel of its own connection (channels in one process share them by default).
    alone = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(suite.scheduler.address, options=alone) as other:
        stranger = scheduler_pb2_grpc.SchedulerStub(other)
        with pytest.raises(grpc.RpcError) as info:
            list(
                stranger.Generate(
                    _request([5, 6], 2, subscription_id=sub, stream_tag=1), timeout=10
                )
            )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == f"subscription_id {sub!r} is not open on this scheduler"
    feed.cancel()


def test_a_tag_in_use_is_refused_and_the_first_request_goes_on(
    suite: TinySuite, tiny_model_dir: Path
) -> None:
    stub = suite.scheduler_stub
    feed = stub.Subscribe(scheduler_pb2.SubscribeRequest(), timeout=120)
    sub = next(feed).subscription_id
    first = stub.Generate(_request([5, 6, 7], 40, subscription_id=sub, stream_tag=9), timeout=60)
    got: dict[int, list[int]] = defaultdict(list)
    batch = next(feed)  # the first request is running: its tokens flow
    for r in batch.responses:
        got[r.stream_tag].extend(r.token_ids)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request([8, 9], 2, subscription_id=sub, stream_tag=9), timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "stream_tag 9 is already in use on this subscription"
    rest, _ = _collect(feed, {9})
    got[9].extend(t for r in rest[9] for t in r.token_ids)
    assert got[9] == reference.greedy(tiny_model_dir, [5, 6, 7], 40)
    assert list(first) == []
    feed.cancel()


def test_closing_the_stream_cancels_its_requests_and_frees_their_blocks(
    suite: TinySuite,
) -> None:
    stub = suite.scheduler_stub
    feed = stub.Subscribe(scheduler_pb2.SubscribeRequest(), timeout=120)
    sub = next(feed).subscription_id
    calls = [
        stub.Generate(_request(p, 400, subscription_id=sub, stream_tag=i + 1), timeout=120)
        for i, p in enumerate(PROMPTS)
    ]
    # every request running (each has made a token) before the stream closes: a request
    # that reaches the scheduler after it closed is refused instead, which is another test
    running: set[int] = set()
    while len(running) < len(calls):
        running |= {r.stream_tag for r in next(feed).responses if r.token_ids}
    feed.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert info.value.details() == (
            f"subscription_id {sub!r} closed; the request was cancelled"
        )

    def pool_free() -> bool:
        stats = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).workers[0]
        return bool(stats.num_running == 0 and stats.num_free_blocks == NUM_KV_BLOCKS)

    until(pool_free, 30, "every block back in the pool")


def test_the_gateway_gives_the_same_tokens_on_either_stream(suite: TinySuite) -> None:
    per_request = suite.suite.start_gateway(
        suite.registry, suite.scheduler, "--scheduler-stream", "per-request", name="gw-own"
    )
    prompts = [f"Canteen serves request {i}" for i in range(6)]

    def run(address: str, prompt: str) -> tuple[list[int], str, int]:
        with grpc.insecure_channel(address) as channel:
            from canteen.v1 import inference_pb2_grpc

            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(
                prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True
            )
            messages = list(stub.Generate(request, timeout=60))
        ids = [t for m in messages for t in m.token_ids]
        return ids, "".join(m.text for m in messages), messages[-1].usage.completion_tokens

    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            shared = list(pool.map(lambda p: run(suite.gateway.address, p), prompts))
            own = list(pool.map(lambda p: run(per_request.address, p), prompts))
    finally:
        per_request.terminate()
    assert shared == own
    assert all(len(ids) == 12 and usage == 12 for ids, _, usage in shared)
    assert "shared token stream open" in suite.gateway.log()
    assert "shared token stream open" not in per_request.log()
