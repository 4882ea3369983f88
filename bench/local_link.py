"""The internal streams on local sockets (the default where the services share a host and
user: the worker's Run, the scheduler's Connect) against gRPC (``--local-link off`` on
the worker, the scheduler and the gateway), side by side.

Two suites run at once, the same but for those flags (both idle while the other works), on
SmolLM2 or, with ``--tiny``, a tiny random model (steps of about a millisecond, where the
services around the worker bound the suite). Each round sends the same fresh prompts to
each in turn, alternating which goes first, and prints one JSON line per run in the order
they ran: tokens per second, the worker's mean decode step, and the CPU microseconds per
token of the scheduler, of the worker's threads other than the forward's (its event loop
and gRPC's) and of the gateway (bench/suite_probe.py measures the same way). A summary
gives each side's medians.

Usage: python bench/local_link.py [--streams 1,16] [--tokens 256] [--rounds 3] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.suite_probe import probe, tiny_stack
from bench.throughput import NicedClient, questions
from tests.support.suite import default_model_stack

OFF = ["--local-link", "off"]
SIDES: dict[str, list[str]] = {"local": [], "grpc": OFF}


def edge_figures(found: dict) -> dict:
    """The run's tokens per second, step and CPU per token by service (the worker's two
    busiest threads, the forward's, left out)."""
    threads = found["thread_us"]
    worker = sorted(threads["worker"].values(), reverse=True)[2:]
    return {
        "tok_s": found["tok_s"],
        "worker_ms": found["worker_ms"],
        "scheduler_us": sum(threads["scheduler"].values()),
        "worker_edge_us": sum(worker),
        "gateway_us": sum(threads["gateway"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model")
    args = parser.parse_args()
    base = ["--kv-cache-memory", "1GiB", "--dtype", "auto"]
    stacks = tiny_stack if args.tiny else default_model_stack
    rows: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as held:
        sides = {
            name: held.enter_context(
                stacks(
                    Path(tmp) / name,
                    worker_args=[*base, *extra],
                    scheduler_args=extra,
                    gateway_args=extra,
                )
            )
            for name, extra in SIDES.items()
        }
        client = NicedClient()
        for stack in sides.values():
            client.run(stack.gateway.address, questions(4, "warm"), 16)
        order = list(sides)
        for r in range(args.rounds):
            for streams in (int(s) for s in args.streams.split(",")):
                for name in order:
                    found = probe(sides[name], client, streams, args.tokens, f"r{r}s{streams}")
                    row = {"round": r, "side": name, "streams": streams, **edge_figures(found)}
                    rows.setdefault((name, streams), []).append(row)
                    print(json.dumps(row), flush=True)
            order.reverse()
        client.close()
    for (name, streams), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        medians = {k: statistics.median(r[k] for r in runs) for k in edge_figures_keys(runs)}
        print(json.dumps({"side": name, "streams": streams, "median": medians}), flush=True)


def edge_figures_keys(runs: list[dict]) -> list[str]:
    return [k for k in runs[0] if k not in ("round", "side", "streams")]


if __name__ == "__main__":
    main()
