"""Throughput with tracing on vs off, measured with `canteen bench` in one run.

Two SmolLM2 stacks run side by side: one without an OTLP endpoint, one exporting every span
of gateway, scheduler and worker to a real OTLP/gRPC endpoint on loopback. Each round runs
the same workload (N concurrent streams, ignore_eos) on both, alternating which goes first;
the ratio per round is paired. Only one stack is loaded at a time.

Usage: python bench/tracing.py [--streams 16] [--requests 32] [--tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canteen.tools.bench import Concurrency, Limits, Target, random_workload, run_bench
from tests.support.otlp import running_collector
from tests.support.suite import Stack, default_model_stack


async def throughput(stack: Stack, args: argparse.Namespace, seed: int) -> float:
    workload = random_workload(args.requests, 96, args.tokens, seed=seed, tokens_per_word=1.3)
    run = await run_bench(
        Target(address=stack.gateway.address),
        workload,
        Concurrency(args.streams),
        Limits(num_requests=args.requests, progress=False, drain_timeout=600),
    )
    s = run.summary
    assert s.num_failed == 0, s.errors
    assert s.total_output_tokens == args.requests * args.tokens, s.total_output_tokens
    return float(s.output_throughput)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="canteen-bench-tracing-"))
    with running_collector() as (collector, endpoint):
        otlp = ("--otlp-endpoint", endpoint)
        with (
            default_model_stack(work / "off") as off,
            default_model_stack(work / "on", otlp, otlp, otlp) as on,
        ):
            asyncio.run(throughput(off, args, 99))  # warm both before measuring
            asyncio.run(throughput(on, args, 99))
            ratios = []
            for r in range(args.rounds):
                order = [("off", off), ("on", on)] if r % 2 == 0 else [("on", on), ("off", off)]
                got = {name: asyncio.run(throughput(stack, args, r)) for name, stack in order}
                ratios.append(got["on"] / got["off"])
                print(
                    f"round {r + 1}: tracing off {got['off']:.1f} tok/s, on {got['on']:.1f} "
                    f"tok/s, on/off {ratios[-1]:.3f}",
                    flush=True,
                )
        spans = len(collector.spans)
    print(
        f"on/off per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.3f} (target >= 0.97); {spans} spans exported"
    )


if __name__ == "__main__":
    main()
