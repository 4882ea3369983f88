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

``--modes http`` adds a gateway (shared stream) read over HTTP: the same streams as
server-sent events from ``/v1/chat/completions``, to compare the gRPC-facing side of the
gateway with the HTTP one (``bench/http_vs_grpc.py`` does so on SmolLM2). Every run also
prints how many messages (gRPC) or events (HTTP) the client read per token:
``msgs_per_token`` (1.0 at stream interval 1 when every step reached the client alone), and
the host's one-minute load average as it ended (``load_1m``: CPU time per token grows on a
busy host, so compare runs at like loads, or alternate).

``--tiny`` serves a tiny random model (steps of about a millisecond, the regime of a GPU
worker, where the edge services bound the suite); the default is SmolLM2 on the CPU.

Usage: python bench/shared_stream.py [--streams 16,32] [--tokens 64] [--rounds 2] [--tiny]
       [--stream-interval 1] [--modes shared,subscribe,per-request,http]
A short run: --tiny --streams 32 --rounds 1 --modes shared.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import NicedClient, greedy_requests, questions
from canteen.v1 import inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.suite import Service, Suite, wait_serving

MODES = ("shared", "subscribe", "per-request", "http")


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
                registry,
                scheduler,
                "--scheduler-stream",
                "shared" if mode == "http" else mode,
                *flags,
                name=mode,
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


def grpc_run(address: str, texts: list[str], tokens: int) -> tuple[float, int]:
    """Tokens per second of ``texts`` streamed at once over gRPC, and the messages read
    (every call is sent before any is read, as ``bench.throughput.suite_run`` does)."""
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        requests = greedy_requests(texts, tokens)

        def read(call: Any) -> tuple[int, int]:
            counts = [len(m.token_ids) for m in call]
            return sum(counts), len(counts)

        start = time.perf_counter()
        calls = [stub.Generate(req, timeout=900) for req in requests]
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            read_back = list(pool.map(read, calls))
    produced = sum(n for n, _ in read_back)
    assert produced == len(texts) * tokens, produced
    return produced / (time.perf_counter() - start), sum(m for _, m in read_back)


def http_run(url: str, texts: list[str], tokens: int) -> tuple[float, int]:
    """The same over HTTP: server-sent events of /v1/chat/completions, and the text events
    read (the usage and [DONE] events not counted)."""
    import aiohttp

    async def main() -> tuple[float, int]:
        async with aiohttp.ClientSession() as session:

            async def one(text: str) -> tuple[int, int]:
                body = {
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                completion = events = 0
                async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
                    async for line in reply.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            completion = chunk["usage"]["completion_tokens"]
                        elif chunk.get("choices"):
                            events += 1
                return completion, events

            start = time.perf_counter()
            read_back = await asyncio.gather(*(one(text) for text in texts))
            produced = sum(n for n, _ in read_back)
            assert produced == len(texts) * tokens, produced
            return produced / (time.perf_counter() - start), sum(m for _, m in read_back)

    return asyncio.run(main())


def run(
    client: NicedClient,
    scheduler: Service,
    gateway: Service,
    streams: int,
    tokens: int,
    tag: str,
    is_http: bool = False,
) -> dict[str, float]:
    steps = num_steps(scheduler)
    before = cpu(scheduler), cpu(gateway)
    started = time.perf_counter()
    texts = questions(streams, tag)
    if is_http:
        tps, messages = client.submit(http_run, gateway.http_url, texts, tokens)
    else:
        tps, messages = client.submit(grpc_run, gateway.address, texts, tokens)
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
        "msgs_per_token": round(messages / made, 3),
        "load_1m": round(os.getloadavg()[0], 2),  # the host's load as the run ended
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
                run(client, scheduler, gateways[mode], widest, 16, f"warm-{mode}", mode == "http")
            for r in range(args.rounds):
                order = modes if r % 2 == 0 else modes[::-1]
                for streams in (int(s) for s in args.streams.split(",")):
                    for mode in order:
                        tag = f"r{r}-{mode}"
                        gateway = gateways[mode]
                        row = run(
                            client, scheduler, gateway, streams, args.tokens, tag, mode == "http"
                        )
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
            "msgs_per_token": {m: medians[m]["msgs_per_token"] for m in modes},
            "edge_us": {
                m: round(medians[m]["scheduler_us"] + medians[m]["gateway_us"], 1) for m in modes
            },
        }
        for other in ("subscribe", "per-request", "http"):
            if {"shared", other} <= set(modes):
                ratio = medians["shared"]["tok_s"] / medians[other]["tok_s"]
                summary[f"shared_over_{other.replace('-', '_')}"] = round(ratio, 3)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
