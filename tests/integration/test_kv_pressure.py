"""The KV pool under five times more demand than it holds, with cancellations mid-stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2
from tests.integration.conftest import BLOCK_SIZE, TinySuite, tiny_suite
from tests.support import reference

WORDS = ["king", "queen", "Paris", "Rome", "time", "land", "far", "away", "capital", "tokens"]
NUM_REQUESTS, NUM_CANCELLED, MAX_TOKENS = 200, 50, 12
# A pool of its own, small enough that arrivals outrun it on any machine (the shared
# suite's 96 blocks filled only in the first half second, and on some runs not at all).
NUM_KV_BLOCKS = 32
SHARED = "Once upon a time, in a land far away, "


def _prompt(i: int) -> str:
    words = " ".join(WORDS[(i * k + k) % len(WORDS)] for k in range(1, 4))
    return f"{SHARED}{words} {i}" if i % 2 else f"{words} {i}"


async def _run(
    stub: inference_pb2_grpc.InferenceStub, i: int, cancel_after: int | None
) -> tuple[list[int], inference_pb2.GenerateResponse | None]:
    request = inference_pb2.GenerateRequest(
        prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
    )
    call = stub.Generate(request, timeout=120)
    ids: list[int] = []
    last = None
    async for message in call:
        ids.extend(message.token_ids)
        last = message
        if cancel_after is not None and len(ids) >= cancel_after:
            call.cancel()
            break
    return ids, last


async def _run_all(address: str) -> list[tuple[list[int], inference_pb2.GenerateResponse | None]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return await asyncio.gather(
            *(_run(stub, i, 1 + (i // 4) % 8 if i % 4 == 0 else None) for i in range(NUM_REQUESTS))
        )


def _stats(suite: TinySuite) -> scheduler_pb2.WorkerStats:
    stats: scheduler_pb2.GetStatsResponse = suite.scheduler_stub.GetStats(
        scheduler_pb2.GetStatsRequest(), timeout=5
    )
    (worker,) = stats.workers
    return worker


@pytest.fixture(scope="module")
def small_suite(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinySuite]:
    # The worker's defaults: preemption by recompute is exact in the default dtype.
    workdir = tmp_path_factory.mktemp("kv-pressure")
    with tiny_suite(workdir, tiny_model_dir, NUM_KV_BLOCKS, dtype=()) as tiny:
        yield tiny


def test_five_times_the_pool_all_complete_exactly_and_every_block_comes_back(
    small_suite: TinySuite, tiny_model_dir: Path
) -> None:
    suite = small_suite
    tok = reference.tokenizer(tiny_model_dir)
    prompt_ids = [
        tok(_prompt(i), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        for i in range(NUM_REQUESTS)
    ]
    demand = sum(-(-(len(p) + MAX_TOKENS) // BLOCK_SIZE) for p in prompt_ids)
    assert demand >= 5 * NUM_KV_BLOCKS
    before = _stats(suite)

    results = asyncio.run(_run_all(suite.gateway.address))

    cancelled = [i for i in range(NUM_REQUESTS) if i % 4 == 0]
    assert len(cancelled) == NUM_CANCELLED
    after = _wait_idle(suite)
    for i, (ids, last) in enumerate(results):
        expected = _alone(suite, i)  # the same request on the idle suite
        if i in cancelled:
            assert ids == expected[: len(ids)] and len(ids) >= 1, i
        else:
            assert ids == expected, i
            assert last is not None and last.usage.completion_tokens == MAX_TOKENS
    assert after.num_preemptions > before.num_preemptions  # the pool really ran out
    assert after.prefix_cache_hit_rate > 0
    # Every block is free (plain or cached) and none is referenced by a sequence.
    assert (after.num_free_blocks, after.num_running, after.num_waiting) == (NUM_KV_BLOCKS, 0, 0)
    assert after.num_cached_blocks > 0


def _alone(suite: TinySuite, i: int) -> list[int]:
    request = inference_pb2.GenerateRequest(
        prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
    )
    reply = suite.inference.Complete(request, timeout=60)
    return list(reply.token_ids)


def _wait_idle(suite: TinySuite) -> scheduler_pb2.WorkerStats:
    deadline = time.monotonic() + 30
    while True:
        worker = _stats(suite)
        if worker.num_running == worker.num_waiting == 0 or time.monotonic() > deadline:
            return worker
        time.sleep(0.05)
