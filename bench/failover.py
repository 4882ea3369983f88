"""How fast streams resume after a worker is SIGKILLed, on SmolLM2 with two workers.

N greedy streams run through the gateway on two workers. Once every stream has tokens, the
worker holding more of them is killed. For each stream that was on it, the resume gap is the
time from the kill to its next token. The scheduler re-runs each moved sequence from prompt
plus generated tokens, so part of the gap is recompute: the bench measures the survivor's
prefill rate beforehand (one long prompt's TTFT) and reports gap - recompute estimate, where
the estimate is all moved tokens at that rate (they are recomputed together).

Usage: python bench/failover.py [--streams 16] [--tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import QUESTIONS
from canteen.models import DEFAULT_MODEL_NAME
from canteen.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.suite import Suite, wait_serving


async def stream(stub: inference_pb2_grpc.InferenceStub, i: int, tokens: int) -> list[float]:
    """Arrival time of each token of one stream."""
    req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
    req.messages.messages.add(role="user", content=QUESTIONS[i % len(QUESTIONS)])
    times: list[float] = []
    async for msg in stub.Generate(req, timeout=600, metadata=(("x-request-id", f"fo-{i}"),)):
        times.extend([time.monotonic()] * len(msg.token_ids))
    assert len(times) == tokens
    return times


async def prefill_rate(stub: inference_pb2_grpc.InferenceStub) -> float:
    """Prompt tokens per second of one cold prefill (TTFT of a long prompt)."""
    req = inference_pb2.GenerateRequest(prompt="word " * 400, max_tokens=1, ignore_eos=True)
    start = time.monotonic()
    async for msg in stub.Generate(req, timeout=600):
        usage = msg.usage
    return usage.prompt_tokens / (time.monotonic() - start)


async def measure(suite: Suite, gateway: str, scheduler: str, args: argparse.Namespace) -> None:
    async with grpc.aio.insecure_channel(gateway) as ch, grpc.aio.insecure_channel(scheduler) as sc:
        stub = inference_pb2_grpc.InferenceStub(ch)
        rate = await prefill_rate(stub)
        tasks = [asyncio.ensure_future(stream(stub, i, args.tokens)) for i in range(args.streams)]
        sched = scheduler_pb2_grpc.SchedulerStub(sc)
        while True:
            stats = await sched.GetStats(scheduler_pb2.GetStatsRequest())
            running = {w.worker_id: w for w in stats.workers}
            busy = [w for w in running.values() if w.num_running]
            if len(busy) == 2 and all(r.num_output_tokens for w in busy for r in w.running):
                break
            await asyncio.sleep(0.05)
        victim = max(running, key=lambda w: running[w].num_running)
        moved_tokens = sum(
            s.num_prompt_tokens + s.num_output_tokens for s in running[victim].running
        )
        victims = {s.request_id for s in running[victim].running}
        svc = next(s for s in suite.services if s.name == victim)
        killed_at = time.monotonic()
        svc.process.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    gaps = sorted(
        min(t for t in times if t > killed_at) - killed_at
        for i, times in enumerate(results)
        if f"fo-{i}" in victims
    )
    recompute = moved_tokens / rate
    print(
        f"killed {victim} holding {len(victims)} of {args.streams} streams "
        f"({moved_tokens} tokens to recompute; survivor prefill {rate:.0f} tok/s, "
        f"estimate {recompute:.2f} s)"
    )
    print(
        f"resume gap of the moved streams: median {statistics.median(gaps):.2f} s, "
        f"max {gaps[-1]:.2f} s; max gap - recompute estimate {gaps[-1] - recompute:.2f} s "
        "(target <= 2 s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    suite = Suite(Path(tempfile.mkdtemp(prefix="canteen-bench-failover-")))
    try:
        registry = suite.start_registry()
        scheduler = suite.start_scheduler(registry)
        for name in ("worker-a", "worker-b"):
            suite.start_worker(registry, DEFAULT_MODEL_NAME, "--threads", "1", name=name)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 120)
        gateway = suite.start_gateway(registry, scheduler)
        asyncio.run(measure(suite, gateway.address, scheduler.address, args))
    finally:
        suite.stop()


if __name__ == "__main__":
    main()
