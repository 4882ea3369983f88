"""The scheduler -> gateway hop: one shared stream per gateway against one stream per
request, side by side in one run.

One registry, scheduler and worker, and a gateway per mode in front of the scheduler:
``--scheduler-stream shared`` (the default: requests and tokens on one Connect stream),
``subscribe`` (tokens on one Subscribe stream, a Generate call per request) and
``per-request``. Rounds alternate which gateway goes first, and every run has its own
prompts (no prefix cache helps either side). Prints one JSON line per run, in the order
they ran: tokens per second, and the CPU microseconds per generated token of the
scheduler and of that run's gateway, and the scheduler's CPU microseconds per worker step
(a step's cost does not fall with the stream interval; a token's share of it falls with the
streams in the step). The client runs at nice 19 in its own process.

``--stream-interval N`` starts every gateway with that default stream interval (tokens per
message after a request's first; the shared stream honours it, a per-request stream sends
every step). ``--modes shared`` runs one side only; ``--modes shared,subscribe`` compares
requests as messages against a call each.

``--tiny`` serves a tiny random model (steps of about a millisecond, the regime of a GPU
worker, where the edge services bound the suite); the default is SmolLM2 on the CPU.

Usage: python bench/shared_stream.py [--streams 16,32] [--tokens 64] [--rounds 2] [--tiny]
       [--stream-interval 1] [--modes shared,subscribe,per-request]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import NicedClient, questions
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.support.suite import Service, Suite, wait_serving

MODES = ("shared", "subscribe", "per-request")


@contextlib.contextmanager
def two_gateways(
    workdir: Path, tiny: bool, worker_args: list[str], modes: tuple[str, ...], interval: int
) -> Iterator[tuple[Service, dict[str, Service]]]:
    """The scheduler, and a gateway per mode in front of it."""
    from canteen.models import DEFAULT_MODEL_NAME

    suite = Suite(workdir)
    try:
        if tiny:
            from tests.support.tiny_model import build_tiny_model

            registry = suite.start_tiny_registry(build_tiny_model(workdir / "tiny"))
        else:
            registry = suite.start_registry()
        scheduler = suite.start_scheduler(registry)
        suite.start_worker(registry, "tiny" if tiny else DEFAULT_MODEL_NAME, *worker_args)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 120, role="scheduler")
        flags = ("--stream-interval", str(interval))
        gateways = {
            mode: suite.start_gateway(
                registry, scheduler, "--scheduler-stream", mode, *flags, name=mode
            )
            for mode in modes
        }
        yield scheduler, gateways
    finally:
        suite.stop()


def cpu(service: Service) -> float:
    return sum(psutil.Process(service.process.pid).cpu_times()[:2])


def num_steps(scheduler: Service) -> int:
    """Steps the scheduler's workers have run so far (its GetStats)."""
    with grpc.insecure_channel(scheduler.address) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        )
    return sum(w.num_steps for w in stats.workers)


def run(
    client: NicedClient, scheduler: Service, gateway: Service, streams: int, tokens: int, tag: str
) -> dict[str, float]:
    steps = num_steps(scheduler)
    before = cpu(scheduler), cpu(gateway)
    started = time.perf_counter()
    tps = client.run(gateway.address, questions(streams, tag), tokens)
    wall = time.perf_counter() - started
    used = cpu(scheduler) - before[0], cpu(gateway) - before[1]
    steps = max(num_steps(scheduler) - steps, 1)
    made = streams * tokens
    return {
        "tok_s": round(tps, 1),
        "wall_s": round(wall, 3),
        "scheduler_us": round(1e6 * used[0] / made, 1),
        "gateway_us": round(1e6 * used[1] / made, 1),
        "steps": steps,
        "scheduler_us_per_step": round(1e6 * used[0] / steps, 1),
    }


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="16,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (see above)")
    parser.add_argument(
        "--gateways",
        type=int,
        default=0,
        help="instead: 1 against N gateway processes on one port, each over the engine "
        "in-process (bench/gateway_count.py; with --tiny)",
    )
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    if args.gateways:
        if not args.tiny:
            parser.error("--gateways runs on the tiny model: add --tiny")
        from bench import gateway_count

        widths = [int(s) for s in args.streams.split(",")]
        gateway_count.main(widths, args.tokens, args.rounds, sorted({1, args.gateways}))
        return
    modes = tuple(args.modes.split(","))
    widest = max(int(n) for n in args.streams.split(","))
    worker_args = ["--kv-cache-memory", "1GiB", "--dtype", "auto"]
    found: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        setup = two_gateways(Path(tmp), args.tiny, worker_args, modes, args.stream_interval)
        with setup as (scheduler, gateways):
            client = NicedClient()
            for mode in modes:  # warm both: tokenizer, channels, the shared stream
                client.run(gateways[mode].address, questions(widest, f"warm-{mode}"), 16)
            for r in range(args.rounds):
                order = modes if r % 2 == 0 else modes[::-1]
                for streams in (int(s) for s in args.streams.split(",")):
                    for mode in order:
                        tag = f"r{r}-{mode}"
                        row = run(client, scheduler, gateways[mode], streams, args.tokens, tag)
                        found.setdefault((mode, streams), []).append(row)
                        line = {"round": r, "mode": mode, "streams": streams, **row}
                        print(json.dumps({**line, "stream_interval": args.stream_interval}))
            client.close()
    for streams in (int(s) for s in args.streams.split(",")):
        medians = {mode: median_row(found[(mode, streams)]) for mode in modes}
        summary: dict[str, object] = {
            "streams": streams,
            "stream_interval": args.stream_interval,
            "median_tok_s": {m: medians[m]["tok_s"] for m in modes},
            "scheduler_us": {m: medians[m]["scheduler_us"] for m in modes},
            "gateway_us": {m: medians[m]["gateway_us"] for m in modes},
            "scheduler_us_per_step": {m: medians[m]["scheduler_us_per_step"] for m in modes},
            "edge_us": {
                m: round(medians[m]["scheduler_us"] + medians[m]["gateway_us"], 1) for m in modes
            },
        }
        for other in ("subscribe", "per-request"):
            if {"shared", other} <= set(modes):
                ratio = medians["shared"]["tok_s"] / medians[other]["tok_s"]
                summary[f"shared_over_{other.replace('-', '_')}"] = round(ratio, 3)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
