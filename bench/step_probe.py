"""One side of bench/revisions.py: loads SmolLM2 with the default settings from whatever tree
is first on PYTHONPATH, and prints one JSON line of timings (ms): a decode step at each
--batches width (median of --steps steps after a warm-up) and the prefill of one --prompt
token prompt in chunks of max_batched_tokens. It uses only the runner's public API, which
both revisions share."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from canteen.models import default_model_path
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan

try:
    from worker.engine.runner import ModelRunner
    from worker.model.loader import LoadedModel, choose_dtype, load_model
except ImportError:  # revisions before worker/ was grouped (bench/revisions.py --base)
    from worker.loader import LoadedModel, choose_dtype, load_model  # type: ignore[no-redef]
    from worker.runner import ModelRunner  # type: ignore[no-redef]

BLOCK = 16
MAX_BATCHED = 2048


def decode_ms(runner: ModelRunner, batch: int, steps: int) -> float:
    runner.reset()
    per = runner.blocks_for(32 + steps + 2)
    seqs = tuple(
        NewSequence(
            f"s{i}",
            tuple(range(10 + i, 42 + i)),
            Sampling(0.0),
            tuple(range(i * per, (i + 1) * per)),
        )
        for i in range(batch)
    )
    plan = StepPlan(0, seqs, tuple(ScheduledSequence(s.seq_id, 32) for s in seqs))
    runner.step(plan)
    times = []
    for step in range(1, steps + 2):
        started = time.perf_counter()
        runner.step(StepPlan(step, (), tuple(ScheduledSequence(s.seq_id, 1) for s in seqs)))
        if step > 1:  # the first decode step warms up
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def prefill_ms(runner: ModelRunner, prompt: int) -> float:
    runner.reset()
    ids = tuple(100 + (i * 37) % 20000 for i in range(prompt))
    blocks = tuple(range(runner.blocks_for(prompt + 1)))
    new = NewSequence("p", ids, Sampling(0.0), blocks)
    started = time.perf_counter()
    done, step = 0, 0
    while done < prompt:
        n = min(MAX_BATCHED, prompt - done)
        runner.step(StepPlan(step, (new,) if step == 0 else (), (ScheduledSequence("p", n),)))
        done, step = done + n, step + 1
    return (time.perf_counter() - started) * 1e3


def make_runner(loaded: LoadedModel, num_blocks: int) -> ModelRunner:
    """The runner as this tree builds it, or as revisions before RunnerConfig did (the base
    of bench/revisions.py may be either)."""
    try:
        from worker.engine.runner import RunnerConfig
    except ImportError:  # before RunnerConfig, or before worker/ was grouped
        return ModelRunner(loaded, num_blocks, BLOCK, max_batched_tokens=MAX_BATCHED)  # type: ignore[arg-type]
    return ModelRunner(loaded, RunnerConfig(num_blocks, BLOCK, max_batched_tokens=MAX_BATCHED))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    device = torch.device("cpu")
    dtype, _ = choose_dtype(args.dtype, device, args.quantization)
    loaded = load_model(
        str(default_model_path()), "gguf", "", device, dtype, False, quantization=args.quantization
    )
    batches = [int(b) for b in args.batches.split(",")]
    num_blocks = max(max(batches) * 4, -(-args.prompt // BLOCK) + 2)
    runner = make_runner(loaded, num_blocks)
    out: dict[str, float] = {}
    with torch.inference_mode():
        prefill_ms(runner, 64)  # warm-up
        for batch in batches:
            out[f"decode@{batch}"] = decode_ms(runner, batch, args.steps)
        out[f"prefill {args.prompt}"] = prefill_ms(runner, args.prompt)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
