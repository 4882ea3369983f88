"""Several workers behind one scheduler: cache affinity, capacity routing, the bounded queue,
and a worker that sizes its pool from a memory fraction."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from canteen.v1 import (
    inference_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.integration.conftest import TinySuite
from tests.support.streams import Stream, until
from tests.support.suite import Service, Suite
from tests.support.tiny_model import build_tiny_model
from worker.model.loader import choose_dtype

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
    reply: inference_pb2.CompleteResponse = suite.inference.Complete(request, timeout=60)
    return reply


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


def test_a_deadline_that_expires_in_the_queue_is_deadline_exceeded_and_leaks_nothing(
    two: TinySuite,
) -> None:
    # Both requests need 45 blocks: only worker-b holds them, one at a time. worker-b is
    # paused (SIGSTOP) under the first, so the second waits in the queue past its deadline.
    worker_b = next(svc for svc in two.suite.services if svc.name == "worker-b")
    request = inference_pb2.GenerateRequest(
        prompt="a " * 60, max_tokens=45 * BLOCK - 60, temperature=0, ignore_eos=True
    )
    running = two.inference.Generate(request, timeout=120)
    got = list(next(running).token_ids)
    os.kill(worker_b.process.pid, signal.SIGSTOP)
    try:
        queued = two.inference.Generate(request, timeout=3)
        until(lambda: _stats(two)["worker-b"].num_waiting == 1, 3, "the request to queue")
        with pytest.raises(grpc.RpcError) as info:
            list(queued)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Gone from the queue at once, while the first still holds the worker.
        until(lambda: _stats(two)["worker-b"].num_waiting == 0, 10, "the queue to empty")
        assert _stats(two)["worker-b"].num_running == 1
    finally:
        os.kill(worker_b.process.pid, signal.SIGCONT)
    got += [t for msg in running for t in msg.token_ids]
    assert len(got) == request.max_tokens  # the running stream was untouched

    def idle() -> bool:
        b = _stats(two)["worker-b"]
        return (b.num_free_blocks, b.num_running, b.num_waiting) == (LARGE, 0, 0)

    until(idle, 10, "every block back and nothing queued or running")


# A model whose KV is wide (64 KiB per token in float32), so a pool sized in MiB from a memory
# fraction holds few enough tokens for a test to fill it.
WIDE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
WIDE_POOL = 160 * 2**20  # the pool the second worker's fraction aims at


def _info(worker: Service) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(worker.address) as channel:
        info: worker_pb2.WorkerInfo = worker_pb2_grpc.WorkerStub(channel).GetInfo(
            worker_pb2.GetInfoRequest()
        )
        return info


def _peak_rss(pid: int) -> int:
    """VmHWM: the most the process ever held resident."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _fraction_for(pool_bytes: int, fraction: float, info: worker_pb2.WorkerInfo) -> float:
    """The fraction that gives a pool of ``pool_bytes``, from a worker started with
    ``fraction``: the pool moves by 0.95 x the change of fraction x available RAM."""
    available = psutil.virtual_memory().available
    return round(fraction - (info.kv_cache_bytes - pool_bytes) / (0.95 * available), 6)


def test_memory_fraction_sizes_the_pool_and_the_worker_stays_in_budget_under_load(
    tmp_path: Path,
) -> None:
    model = build_tiny_model(tmp_path / "wide", **WIDE)
    s = Suite(tmp_path)
    try:
        registry = s.start_tiny_registry(model)
        scheduler = s.start_scheduler(registry)
        # Canteen's own forward (the default) in the CPU's dtype: in bfloat16 every new
        # matmul shape once cost oneDNN a cached kernel (~0.6 MiB), 35-100 MB past the budget
        # under load, until rows were bucketed and the buckets built at load
        # (worker/model/quant.py).
        args = (
            "--dtype",
            "auto",
            "--block-size",
            str(BLOCK),
            "--threads",
            "1",
        )
        # A first worker learns what a fraction gives here; the second aims at WIDE_POOL.
        first = round(min(0.9, 1.5 * 2**30 / psutil.virtual_memory().available), 6)
        probe = s.start_worker(
            registry, "tiny", "--memory-fraction", str(first), *args, name="probe"
        )
        fraction = _fraction_for(WIDE_POOL, first, _info(probe))
        assert probe.terminate() == 0
        worker = s.start_worker(registry, "tiny", "--memory-fraction", str(fraction), *args)
        info = _info(worker)
        dtype, reason = choose_dtype("auto", torch.device("cpu"))
        assert (info.dtype, info.dtype_reason, info.quantization) == (
            str(dtype).removeprefix("torch."),
            reason,
            "none",
        )
        assert info.num_blocks * info.bytes_per_block == info.kv_cache_bytes
        assert info.peak_bytes_before_kv + info.kv_cache_bytes < info.memory_budget_bytes
        gateway = s.start_gateway(registry, scheduler)
        used = _fill_the_pool(gateway.address, scheduler.address, info.num_blocks)
        # The load held nearly the whole pool, and the worker stayed within its budget.
        assert used >= 0.8 * info.num_blocks, (used, info.num_blocks)
        assert _peak_rss(worker.process.pid) <= info.memory_budget_bytes
    finally:
        s.stop()


def _fill_the_pool(gateway: str, scheduler: str, num_blocks: int) -> int:
    """Streams that need ~90% of the pool at once; the most blocks in use while they ran."""
    tokens = int(0.9 * num_blocks * BLOCK)
    count = max(8, -(-tokens // 900))  # at most 900 tokens each: the context is 1024
    streams = [Stream(gateway, f"Fill the pool, part {i}", 1) for i in range(count)]
    per_stream = tokens // count - 16
    assert per_stream > 16, f"a pool of {num_blocks} blocks is too small to fill"
    for stream in streams:
        stream.request.max_tokens = per_stream
        stream.start()
    most = 0
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while any(stream.is_alive() for stream in streams):
            stats = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
            most = max([most, *(w.num_total_blocks - w.num_free_blocks for w in stats.workers)])
            time.sleep(0.05)
    for stream in streams:
        assert stream.error is None, stream.error
        assert len(stream.tokens) == stream.request.max_tokens
    return most
