"""Output throughput over the OpenAI-compatible HTTP edge vs over gRPC, in one run.

One suite on SmolLM2; each round runs N concurrent streams of M new tokens (ignore_eos)
over gRPC (canteen.v1.Inference/Generate) and then over HTTP (server-sent events from
/v1/chat/completions, read with aiohttp), alternating which goes first. The ratio per
round is paired. Each run also reports the CPU microseconds per generated token of the
gateway and of the scheduler (process user + system time): the edge's own cost, which the
client's parsing (in this process, not niced) does not blur.

Usage: python bench/http_vs_grpc.py [--streams 16] [--tokens 64] [--rounds 3] [--json out.json]
A short run: --rounds 1 --tokens 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import QUESTIONS
from canteen.models import DEFAULT_MODEL_NAME
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import default_model_stack


async def over_grpc(address: str, n: int, tokens: int, tag: str = "") -> float:
    """Output tok/s of ``n`` concurrent greedy streams; ``tag`` makes the prompts new."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> int:
            req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
            question = QUESTIONS[i % len(QUESTIONS)]
            req.messages.messages.add(
                role="user", content=f"({tag}, {i}) {question}" if tag else question
            )
            return sum([len(m.token_ids) async for m in stub.Generate(req, timeout=600)])

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(i) for i in range(n))))
    assert produced == n * tokens, produced
    return produced / (time.perf_counter() - start)


async def over_http(url: str, n: int, tokens: int) -> float:
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            body = {
                "model": DEFAULT_MODEL_NAME,
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            completion = 0
            async with session.post(f"{url}/v1/chat/completions", json=body) as reply:
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            completion = chunk["usage"]["completion_tokens"]
            return completion

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(i) for i in range(n))))
    assert produced == n * tokens, produced
    return produced / (time.perf_counter() - start)


def cpu_seconds(pid: int) -> float:
    return sum(psutil.Process(pid).cpu_times()[:2])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"grpc": [], "http": []}
    cpu_us: dict[str, dict[str, list[float]]] = {
        kind: {"gateway": [], "scheduler": []} for kind in results
    }
    with tempfile.TemporaryDirectory() as tmp:
        with default_model_stack(Path(tmp), worker_args=["--kv-cache-memory", "512MiB"]) as s:
            gateway = s.gateway
            pids = {"gateway": gateway.process.pid, "scheduler": s.scheduler.process.pid}
            asyncio.run(over_grpc(gateway.address, 2, 4))  # warm both paths
            asyncio.run(over_http(gateway.http_url, 2, 4))
            for r in range(args.rounds):
                order = ["grpc", "http"] if r % 2 == 0 else ["http", "grpc"]
                for kind in order:
                    run = (
                        over_http(gateway.http_url, args.streams, args.tokens)
                        if kind == "http"
                        else over_grpc(gateway.address, args.streams, args.tokens)
                    )
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    results[kind].append(asyncio.run(run))
                    for name, pid in pids.items():
                        used = cpu_seconds(pid) - before[name]
                        cpu_us[kind][name].append(1e6 * used / (args.streams * args.tokens))
                print(
                    f"round {r + 1}: grpc {results['grpc'][-1]:.1f} tok/s, "
                    f"http {results['http'][-1]:.1f} tok/s; gateway CPU us/token "
                    f"grpc {cpu_us['grpc']['gateway'][-1]:.1f}, "
                    f"http {cpu_us['http']['gateway'][-1]:.1f}",
                    flush=True,
                )
    paired = [h / g for h, g in zip(results["http"], results["grpc"], strict=True)]
    report = {
        "streams": args.streams,
        "tokens": args.tokens,
        "tok_per_s": results,
        "http_over_grpc_per_round": paired,
        "http_over_grpc_median": statistics.median(paired),
        "cpu_us_per_token_median": {
            kind: {name: round(statistics.median(v), 1) for name, v in by.items()}
            for kind, by in cpu_us.items()
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
