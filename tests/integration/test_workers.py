"""Several workers behind one scheduler: cache affinity, capacity routing, the bounded queue,
and a worker that sizes its pool from a memory fraction."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from canteen.v1 import inference_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import TinySuite
from tests.support.suite import Suite
from worker.loader import choose_dtype

BLOCK = 8
SMALL, LARGE = 40, 64  # blocks of worker-a and worker-b
PREFIX = "Once upon a time, in a land far away, there lived a king and a queen. " * 2
WORKER_ARGS = ("--block-size", str(BLOCK), "--threads", "1", "--max-batched-tokens", "256")


@pytest.fixture(scope="module")
def two(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinySuite]:
    """Starts with worker-a only; the first test adds worker-b."""
    s = Suite(tmp_path_factory.mktemp("two-workers"))
    try:
        registry = s.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
            "--default-model",
            "tiny",
        )
        scheduler = s.start_scheduler(registry, "--max-queue", "2", "--max-num-seqs", "1")
        worker = s.start_worker(
            registry, "tiny", "--num-kv-blocks", str(SMALL), *WORKER_ARGS, name="worker-a"
        )
        gateway = s.start_gateway(registry, scheduler)
        tiny = TinySuite(s, registry, scheduler, worker, gateway)
        yield tiny
        tiny.channel.close()
        tiny.sched_channel.close()
    finally:
        s.stop()


def _stats(suite: TinySuite) -> dict[str, scheduler_pb2.WorkerStats]:
    reply = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    return {w.worker_id: w for w in reply.workers}


def _generate(suite: TinySuite, prompt: str, max_tokens: int = 4) -> inference_pb2.CompleteResponse:
    request = inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    return suite.inference.Complete(request, timeout=60)


def _steps(suite: TinySuite) -> dict[str, int]:
    return {wid: w.num_steps for wid, w in _stats(suite).items()}


def test_a_cached_prefix_keeps_going_to_its_worker_and_the_rest_to_the_roomiest(
    two: TinySuite,
) -> None:
    _generate(two, PREFIX + "first")  # only worker-a exists: it caches the prefix
    two.suite.start_worker(
        two.registry, "tiny", "--num-kv-blocks", str(LARGE), *WORKER_ARGS, name="worker-b"
    )
    deadline = time.monotonic() + 30
    while len([w for w in _stats(two).values() if w.is_ready]) < 2:
        assert time.monotonic() < deadline, "the scheduler never saw worker-b"
        time.sleep(0.1)

    before = _steps(two)
    reply = _generate(two, PREFIX + "second")
    after = _steps(two)
    # worker-b has more free blocks, but worker-a holds the prefix.
    assert reply.usage.cached_tokens >= 4 * BLOCK
    assert after["worker-a"] > before["worker-a"] and after["worker-b"] == before["worker-b"]

    reply = _generate(two, "def fibonacci(n): return n")
    final = _steps(two)
    assert reply.usage.cached_tokens == 0
    assert final["worker-b"] > after["worker-b"] and final["worker-a"] == after["worker-a"]


def test_a_request_too_big_for_one_worker_goes_to_the_one_it_fits(two: TinySuite) -> None:
    before = _steps(two)
    # 45 blocks: more than worker-a's 40, within worker-b's 64.
    reply = _generate(two, "a " * 60, max_tokens=45 * BLOCK - 60)
    assert reply.finish_reason
    after = _steps(two)
    assert after["worker-b"] > before["worker-b"] and after["worker-a"] == before["worker-a"]


def test_a_full_queue_answers_resource_exhausted_at_once(two: TinySuite) -> None:
    # Each request needs 45 blocks, so only worker-b takes them, and it runs one at a time
    # (--max-num-seqs 1): the second and third wait, the fourth finds the queue full.
    request = inference_pb2.GenerateRequest(
        prompt="a " * 60, max_tokens=45 * BLOCK - 60, temperature=0, ignore_eos=True
    )
    running = two.inference.Generate(request, timeout=60)
    next(running)  # admitted and decoding
    waiting = [two.inference.Generate(request, timeout=60) for _ in range(2)]  # sent at once
    deadline = time.monotonic() + 10
    while _stats(two)["worker-b"].num_waiting < 2:
        assert time.monotonic() < deadline, "the two requests never queued"
        time.sleep(0.02)

    with pytest.raises(grpc.RpcError) as info:
        _generate(two, "hello")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting queue is full (2 requests)" in str(info.value.details())
    assert _stats(two)["worker-b"].num_running == 1  # the running stream was untouched
    running.cancel()
    for call in waiting:
        call.cancel()
    deadline = time.monotonic() + 10
    while any(w.num_running or w.num_waiting for w in _stats(two).values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _stats(two)["worker-b"].num_free_blocks == LARGE


def test_memory_fraction_sizes_the_pool_and_the_worker_stays_in_budget(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    s = Suite(tmp_path)
    try:
        registry = s.start_registry(
            "--no-register-default", "--add-model", f"tiny:v1={tiny_model_dir}"
        )
        # About 1 GiB of budget beyond what the process holds, whatever this machine has free.
        fraction = round(min(0.9, 2**30 / psutil.virtual_memory().available), 4)
        worker = s.start_worker(
            registry, "tiny", "--memory-fraction", str(fraction), "--dtype", "auto", *WORKER_ARGS
        )
        with grpc.insecure_channel(worker.address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        dtype, reason = choose_dtype("auto", torch.device("cpu"))
        assert (info.dtype, info.dtype_reason, info.quantization) == (
            str(dtype).removeprefix("torch."),
            reason,
            "none",
        )
        available = psutil.virtual_memory().available
        assert info.num_blocks * info.bytes_per_block == info.kv_cache_bytes
        assert info.peak_bytes_before_kv + info.kv_cache_bytes < info.memory_budget_bytes
        # The budget is what the process held at start plus the fraction of what was free.
        assert info.memory_budget_bytes <= fraction * (available + info.kv_cache_bytes) + 2**30
        rss = psutil.Process(worker.process.pid).memory_info().rss
        assert rss <= info.memory_budget_bytes
    finally:
        s.stop()
