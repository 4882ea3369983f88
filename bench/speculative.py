"""What speculative decoding buys, side by side in one run: the same suite and worker, each
request with drafts or with ``disable_speculation`` (so neither side has a process, a model
or a cache the other lacks; every request's prompt is new, so no prefix cache helps).

Cases (SmolLM2, greedy; the two sides make identical tokens; the busy case's streams run to
exactly --tokens tokens each, ignore_eos, so both sides do the same work):
  edit    one stream asked to repeat and lightly edit a paragraph (drafts hold often)
  open    one stream, open-ended questions
  busy    N concurrent open-ended streams (drafts must not hurt a busy server)

A round of a one-stream case runs ``--repeats`` fresh prompts per side, and of the busy case
``--busy-repeats`` runs of N fresh streams per side, alternating which side goes first each
time (the host's speed drifts within seconds); rounds are reported in
the order they ran, with the acceptance rate the scheduler measured over the drafting side's
requests.

Usage: python bench/speculative.py [--rounds 3] [--tokens 96] [--streams 16] [--repeats 4]
       [--busy-repeats 4]
       [--speculative ngram|draft-int4] [--cases edit,open,busy]
       [--worker-arg=... ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from bench.throughput import QUESTIONS
from canteen.models import DEFAULT_MODEL_NAME
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import default_model_stack

PARAGRAPHS = [
    "The kitchen opens at six. Orders arrive from every table, and the cooks batch them so "
    "the stoves never idle. Each plate leaves as soon as it is ready, hot and on time.",
    "A library keeps its books on open shelves. Readers take what they need, sit where they "
    "like, and return each book to the cart by the door when they are done with it.",
    "The river runs past the mill and under the old bridge. In spring it floods the meadow, "
    "and in summer children wade across it to fish for the small silver trout.",
]


def edit_prompt(i: int, tag: str) -> str:
    text = PARAGRAPHS[i % len(PARAGRAPHS)]
    return (
        f"({tag}) Repeat this paragraph exactly, but write 'quickly' after the first verb:"
        f"\n\n{text}"
    )


def open_prompt(i: int, tag: str) -> str:
    return f"({tag}) {QUESTIONS[i % len(QUESTIONS)]} Answer in detail."


async def run(
    address: str, prompts: list[str], tokens: int, disable: bool
) -> tuple[float, list[list[int]]]:
    """Output tok/s of the prompts as concurrent streams, and their tokens."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(prompt: str) -> list[int]:
            # Several streams run to exactly ``tokens`` each, so both sides do the same work
            # (with EOS, the side whose prompts happened to end sooner drained to small
            # batches sooner: about 5% either way in the 16-stream case). One stream keeps
            # EOS: past its answer an edit request's text stops repeating the paragraph.
            req = inference_pb2.GenerateRequest(
                max_tokens=tokens,
                temperature=0,
                disable_speculation=disable,
                ignore_eos=len(prompts) > 1,
            )
            req.messages.messages.add(role="user", content=prompt)
            return [t async for m in stub.Generate(req, timeout=600) for t in m.token_ids]

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
    return sum(map(len, outputs)) / (time.perf_counter() - start), list(outputs)


def counters(metrics_url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) the scheduler has counted so far."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()

    def total(name: str) -> float:
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))

    return total("canteen_speculative_draft_tokens_total"), total(
        "canteen_speculative_accepted_tokens_total"
    )


def case(stack: object, name: str, r: int, n: int, tokens: int, repeats: int) -> dict[str, float]:
    """One round of a case: ``repeats`` times, the same number of fresh prompts per side,
    the side that goes first alternating each time (the host's speed drifts within seconds),
    each side's tok/s over all of its requests."""
    address = stack.gateway.address  # type: ignore[attr-defined]
    metrics = stack.scheduler.metrics_url  # type: ignore[attr-defined]
    make = edit_prompt if name == "edit" else open_prompt
    made = {"on": 0, "off": 0}
    seconds = {"on": 0.0, "off": 0.0}
    drafted = accepted = 0.0
    for j in range(repeats):
        for disable in [False, True] if (r + j) % 2 == 0 else [True, False]:
            side = "off" if disable else "on"
            first = (r * repeats + j) * n
            prompts = [make(first + i, f"r{r}.{j} {name} {side}") for i in range(n)]
            before = counters(metrics)
            start = time.perf_counter()
            _, outputs = asyncio.run(run(address, prompts, tokens, disable))
            seconds[side] += time.perf_counter() - start
            made[side] += sum(map(len, outputs))
            after = counters(metrics)
            if not disable:
                drafted += after[0] - before[0]
                accepted += after[1] - before[1]
    out = {side: made[side] / seconds[side] for side in ("on", "off")}
    out["acceptance"] = accepted / drafted if drafted else 0.0
    out["ratio"] = out["on"] / out["off"]
    print(
        f"round {r + 1} {name}: on {out['on']:.1f} tok/s, off {out['off']:.1f} tok/s, "
        f"ratio {out['ratio']:.2f}, acceptance {out['acceptance']:.2f}",
        flush=True,
    )
    # same prompts differ by their side tag, so compare nothing token for token here: the
    # exactness tests do (in bfloat16 a different batch shape may change a rounding)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=4, help="requests per side per round of a one-stream case"
    )
    parser.add_argument(
        "--busy-repeats", type=int, default=4, help="runs of --streams streams per side per round"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--speculative",
        choices=("ngram", "draft-int4"),
        default="ngram",
        help="draft-int4: the served model at --quantization int4 as the draft model",
    )
    parser.add_argument("--worker-arg", action="append", default=[])
    parser.add_argument("--cases", default="edit,open,busy", help="a subset of edit,open,busy")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    drafts = (
        ["--speculative", "ngram"]
        if args.speculative == "ngram"
        else ["--speculative", "draft", "--draft-model", DEFAULT_MODEL_NAME,
              "--draft-quantization", "int4"]
    )  # fmt: skip
    worker_args = [
        "--kv-cache-memory", "512MiB", "--dtype", "auto", *drafts,
        "--num-speculative-tokens", str(args.num_speculative_tokens), *args.worker_arg,
    ]  # fmt: skip
    sizes = {"edit": 1, "open": 1, "busy": args.streams}
    cases = {name: sizes[name] for name in args.cases.split(",")}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        with default_model_stack(Path(tmp), worker_args=worker_args) as stack:
            for name, n in cases.items():  # warm both sides
                case(stack, name, -1, min(n, 2), 8, 1)
            for r in range(args.rounds):
                for name, n in cases.items():
                    repeats = args.repeats if n == 1 else args.busy_repeats
                    results[name].append(case(stack, name, r, n, args.tokens, repeats))
    report = {
        "cpu": cpu_model(),
        "worker_args": worker_args,
        "tokens": args.tokens,
        "rounds": results,
        "median_ratio": {
            name: round(statistics.median(x["ratio"] for x in rounds), 3)
            for name, rounds in results.items()
        },
        "median_acceptance": {
            name: round(statistics.median(x["acceptance"] for x in rounds), 3)
            for name, rounds in results.items()
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
