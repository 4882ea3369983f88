"""Health and admitted streams under 10x capacity, on SmolLM2, side by side in one run.

The scheduler runs at most --batch sequences per step and queues at most --queue more. First
--batch streams run alone (the baseline); then the same streams run while a flood of 10x
capacity arrives at once, which the queue bound sheds with RESOURCE_EXHAUSTED. Throughout,
a prober calls grpc.health.v1.Health/Check on the gateway every 50 ms. Reported: health
latency p50/p99/max in each phase, the streams' median inter-token gap (flood vs baseline),
and how the flood ended (served, shed).

Usage: python bench/overload.py [--batch 8] [--queue 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import QUESTIONS
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import default_model_stack


async def one(stub: inference_pb2_grpc.InferenceStub, i: int, tokens: int) -> list[float] | str:
    """Token arrival times, or the status code name it failed with."""
    req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
    req.messages.messages.add(role="user", content=QUESTIONS[i % len(QUESTIONS)])
    times: list[float] = []
    try:
        async for msg in stub.Generate(req, timeout=600):
            times.extend([time.monotonic()] * len(msg.token_ids))
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return times


async def probe(address: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="canteen.v1.Inference")
        while not stop.is_set():
            start = time.monotonic()
            reply = await stub.Check(request, timeout=10)
            latencies.append(time.monotonic() - start)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.05)
    return latencies


def gaps(runs: list[list[float] | str]) -> float:
    return statistics.median(
        b - a for times in runs if isinstance(times, list) for a, b in itertools.pairwise(times)
    )


async def phase(address: str, args: argparse.Namespace, flood: int) -> dict[str, object]:
    stop = asyncio.Event()
    prober = asyncio.ensure_future(probe(address, stop))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        streams = [asyncio.ensure_future(one(stub, i, args.tokens)) for i in range(args.batch)]
        await asyncio.sleep(1.0)  # the streams are running before the flood arrives
        extra = [one(stub, 100 + i, args.tokens) for i in range(flood)]
        flooded = await asyncio.gather(*extra)
        admitted = await asyncio.gather(*streams)
    stop.set()
    health = np.array(await prober) * 1000
    return {
        "health_ms": (np.percentile(health, 50), np.percentile(health, 99), health.max()),
        "gap": gaps(admitted),
        "admitted_ok": sum(isinstance(r, list) for r in admitted),
        "flood_served": sum(isinstance(r, list) for r in flooded),
        "flood_shed": sum(r == "RESOURCE_EXHAUSTED" for r in flooded),
        "flood_other": sorted({r for r in flooded if isinstance(r, str)} - {"RESOURCE_EXHAUSTED"}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--queue", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    flood = 10 * (args.batch + args.queue)
    work = Path(tempfile.mkdtemp(prefix="canteen-bench-overload-"))
    sched = ("--max-num-seqs", str(args.batch), "--max-queue", str(args.queue))
    with default_model_stack(work, sched) as stack:
        address = stack.gateway.address
        asyncio.run(phase(address, args, 0))  # warm-up
        base = asyncio.run(phase(address, args, 0))
        over = asyncio.run(phase(address, args, flood))
    for name, p in (("baseline", base), (f"flood of {flood}", over)):
        p50, p99, top = p["health_ms"]  # type: ignore[misc]
        print(
            f"{name}: health p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {top:.1f} ms; "
            f"admitted streams ok {p['admitted_ok']}/{args.batch}, median gap {p['gap']:.3f} s"
        )
    print(
        f"flood: {over['flood_served']} served, {over['flood_shed']} shed with "
        f"RESOURCE_EXHAUSTED, other {over['flood_other']}; admitted streams' gap under flood "
        f"{over['gap'] / base['gap']:.2f}x baseline"  # type: ignore[operator]
    )


if __name__ == "__main__":
    main()
