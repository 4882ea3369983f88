"""The local links on the real suite: the default suite's scheduler drives its worker, and
its gateway's shared stream runs, over Unix sockets, with the tokens of a suite on gRPC
(``--local-link off`` on all three); the sockets are private; a second Run stream on the
worker's is refused while the first keeps serving; a socket that is another worker's is
not taken for this one's; a gateway that cannot reach the scheduler's stays on gRPC."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.frames import FrameError
from canteen.local_socket import BrokenError
from canteen.v1 import (
    common_pb2,
    inference_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from gateway.upstream import Feed, SchedulerClient
from scheduler.local_run import LocalRun
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite, tiny_suite
from tests.support.streams import Stream, until


@pytest.fixture(scope="module")
def grpc_suite(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinySuite]:
    workdir = tmp_path_factory.mktemp("grpc-run")
    off = ("--local-link", "off")
    with tiny_suite(
        workdir,
        tiny_model_dir,
        NUM_KV_BLOCKS,
        worker_args=off,
        scheduler_args=off,
        gateway_args=off,
    ) as tiny:
        yield tiny


def _info(suite: TinySuite) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(suite.worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        info: worker_pb2.WorkerInfo = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return info


def _greedy(suite: TinySuite, prompt: str) -> tuple[list[int], list[float]]:
    request = inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True
    )
    messages = list(suite.inference.Generate(request, timeout=60))
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return [t for m in messages for t in m.token_ids], [x for m in messages for x in m.logprobs]


def test_the_default_suite_runs_on_the_local_link_with_grpcs_tokens(
    suite: TinySuite, grpc_suite: TinySuite
) -> None:
    local, remote = _info(suite), _info(grpc_suite)
    assert local.run_socket and remote.run_socket == ""
    ids, logprobs = _greedy(suite, "The local link carries")
    assert len(ids) == 24
    assert _greedy(grpc_suite, "The local link carries") == (ids, logprobs)
    assert "run stream on the local link" in suite.scheduler.log()
    assert "run stream on the local link" not in grpc_suite.scheduler.log()
    on_socket = "shared token stream on the scheduler's local socket"
    assert on_socket in suite.gateway.log()
    assert on_socket not in grpc_suite.gateway.log()


def _scheduler_socket(suite: TinySuite) -> str:
    connect = suite.scheduler_stub.Connect(iter([]), timeout=10)
    first: scheduler_pb2.ScheduleBatch = next(connect)
    connect.cancel()
    return first.local_socket


def test_the_sockets_are_private(suite: TinySuite, grpc_suite: TinySuite) -> None:
    for socket in (_info(suite).run_socket, _scheduler_socket(suite)):
        path = Path(socket)
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.parent.stat().st_uid == os.getuid()
    assert _scheduler_socket(grpc_suite) == ""


async def test_a_gateway_that_cannot_reach_the_socket_stays_on_grpc(
    suite: TinySuite, tmp_path: Path
) -> None:
    """The scheduler's socket as a gateway on another host sees it: a path with nothing
    there. The shared stream stays on gRPC and carries a request's tokens."""

    class Elsewhere(SchedulerClient):
        async def _open_local(self, path: str) -> Feed | None:
            return await super()._open_local(str(tmp_path / Path(path).name))

    channel = grpc.aio.insecure_channel(suite.scheduler.address)
    client = Elsewhere(scheduler_pb2_grpc.SchedulerStub(channel), 5.0, connect=True, local=True)
    request = scheduler_pb2.ScheduleRequest(
        request_id="elsewhere",
        model="tiny",
        version="v1",
        prompt_token_ids=[5, 6, 7],
        max_tokens=5,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0, top_p=1),
    )
    tokens = [t async for r in client.stream(request, 30, ()) for t in r.token_ids]
    assert len(tokens) == 5
    assert client._feed is not None
    assert isinstance(client._feed.call, grpc.aio.StreamStreamCall)
    await client.close()
    await channel.close()


def test_a_second_stream_on_the_socket_is_refused_and_the_first_keeps_serving(
    suite: TinySuite,
) -> None:
    info = _info(suite)
    stream = Stream(suite.gateway.address, "still streaming", 400)
    stream.start()
    until(lambda: len(stream.tokens) >= 4, 60, "the stream to start")

    async def second() -> str:
        run = await LocalRun.open(info.run_socket, info.worker_id)
        try:
            with pytest.raises(BrokenError) as refused:  # on the write, or on the read
                await run.write(worker_pb2.StepPlan(step_id=1).SerializeToString())
                await run.read()
            return str(refused.value)
        finally:
            run.cancel()

    assert "already serves a Run stream" in asyncio.run(second())
    stream.join(120)
    assert len(stream.tokens) == 400 and stream.error is None


def test_another_workers_socket_is_not_taken_for_this_one(suite: TinySuite) -> None:
    info = _info(suite)
    with pytest.raises(FrameError) as wrong:
        asyncio.run(LocalRun.open(info.run_socket, "worker-elsewhere"))
    assert str(wrong.value) == (
        f"the socket {info.run_socket} is {info.worker_id!r}'s, not 'worker-elsewhere''s"
    )
