"""What a constrained row costs one worker step, in the step thread's CPU time (no sockets).

In process on the tiny test model (``--model`` for another directory): one ``ModelRunner``,
``--rows`` sequences decoding together. Rounds alternate ``plain`` (no constraint) and
``constrained`` (every row under a real-world JSON schema from bench/structured_sample.json
that the engine compiles, its answer never complete within the bench's steps, so every step
masks every row); each round runs ``--steps`` decode steps after a prefill, and the figure is
the step thread's CPU seconds per decode step (``time.thread_time``), which the rest of a
loaded host does not inflate the way it does wall time. The mask threads' CPU is counted
apart (the process's CPU minus the step thread's).

The process's CPU per step (every thread) is reported beside it (``process_cpu_ratio``):
on a two-core host the mask threads take their CPU from the same cores as the forward.

Usage: python bench/constrained_step.py [--rows 8] [--steps 64] [--rounds 4]
       [--mask-threads N] [--inline-mask-rows N] (the worker's --grammar-mask-threads and
       --grammar-inline-mask-rows)
       (--rounds 2 --steps 16: a short run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.constrained import SCHEMA
from bench.decode_step import cpu_model
from canteen.plan import Constraint, NewSequence, Sampling, ScheduledSequence, StepPlan
from worker.engine.constrain import GrammarOptions
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model

# bench/constrained.py's list of at least 40 objects: never complete within a round's steps.
LONG = SCHEMA["properties"]["items"]
PER = 16  # blocks per sequence


def schemas(num: int, model_dir: Path) -> list[Constraint]:
    """``num`` constraints: real schemas the engine compiles with the model's tokenizer,
    wrapped so the answer is a long list of them."""
    from bench.structured_data import load_sample
    from canteen.grammar import ConstraintError, GrammarCompiler
    from worker.engine.constrain import load_tokenizer

    compiler = GrammarCompiler(load_tokenizer(str(model_dir), "safetensors"))
    out = []
    for _, schema in load_sample()[0]:
        wrapped = {"type": "array", "minItems": 40, "items": schema}
        constraint = Constraint("json_schema", text=json.dumps(wrapped))
        try:
            compiler.compile(constraint)
        except ConstraintError:
            continue
        out.append(constraint)
        if len(out) == num:
            return out
    return out + [Constraint("json_schema", text=json.dumps(LONG))] * (num - len(out))


def run_round(
    loaded: LoadedModel,
    rows: int,
    steps: int,
    constraints: list[Constraint] | None,
    grammar: GrammarOptions | None = None,
) -> tuple[float, float]:
    """(step-thread CPU s per decode step, other threads' CPU s per decode step)."""
    config = RunnerConfig(rows * PER, 16, 512, grammar=grammar or GrammarOptions())
    runner = ModelRunner(loaded, config)
    prompt = [5, 17, 42, 99, 7, 3, 1, 4]
    news = tuple(
        NewSequence(
            f"s{i}",
            tuple(prompt),
            Sampling(0.0, constraint=constraints[i] if constraints else None),
            tuple(range(i * PER, (i + 1) * PER)),
            0,
            "",
            "",
            len(prompt),
        )
        for i in range(rows)
    )
    seq_ids = [n.seq_id for n in news]
    runner.step(StepPlan(0, news, tuple(ScheduledSequence(s, len(prompt)) for s in seq_ids)))
    for s in seq_ids:  # the compiles are not what this measures: leave them out
        runner.constraints.settle(s, wait=30)
    live = set(seq_ids) & set(runner.sequences)
    assert len(live) == rows, "a sequence failed at its prefill"
    thread0, process0 = time.thread_time(), time.process_time()
    for step in range(1, steps + 1):
        # as the scheduler plans: a row deferred at the prefill computes its prompt again
        seqs = [runner.sequences[s] for s in seq_ids if s in live]
        plan = StepPlan(
            step,
            (),
            tuple(ScheduledSequence(q.seq_id, len(q.tokens) - q.num_computed) for q in seqs),
        )
        result = runner.step(plan)
        live -= {t.seq_id for t in result.tokens if t.token_id in loaded.eos_token_ids}
        live -= {f.seq_id for f in result.failed}
    thread = time.thread_time() - thread0
    other = time.process_time() - process0 - thread
    return thread / steps, other / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", type=Path, help="a transformers model directory")
    parser.add_argument(
        "--mask-threads", type=int, default=0, help="the worker's --grammar-mask-threads"
    )
    parser.add_argument(
        "--inline-mask-rows",
        type=int,
        default=GrammarOptions.inline_mask_rows,
        help="the worker's --grammar-inline-mask-rows (0: masks always beside the forward)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from tests.support.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny")
        loaded = load_model(
            str(model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
        )
        constraints = schemas(args.rows, model_dir)
        grammar = GrammarOptions(
            num_mask_threads=args.mask_threads, inline_mask_rows=args.inline_mask_rows
        )
        run_round(loaded, args.rows, 4, constraints, grammar)  # warm-up: both paths, once
        run_round(loaded, args.rows, 4, None)
        got: dict[str, list[tuple[float, float]]] = {"plain": [], "constrained": []}
        for i in range(args.rounds):
            order = ["plain", "constrained"] if i % 2 == 0 else ["constrained", "plain"]
            for name in order:
                which = constraints if name == "constrained" else None
                got[name].append(run_round(loaded, args.rows, args.steps, which, grammar))
    plain = statistics.median(t for t, _ in got["plain"])
    masked = statistics.median(t for t, _ in got["constrained"])
    # the whole process's CPU: on a two-core host, the mask threads' share competes too
    plain_all = statistics.median(t + o for t, o in got["plain"])
    masked_all = statistics.median(t + o for t, o in got["constrained"])
    summary = {
        "rows": args.rows,
        "plain_step_cpu_ms": round(plain * 1e3, 3),
        "constrained_step_cpu_ms": round(masked * 1e3, 3),
        "constrained_other_threads_cpu_ms": round(
            statistics.median(o for _, o in got["constrained"]) * 1e3, 3
        ),
        "step_cpu_ratio": round(masked / plain, 3),
        "process_cpu_ratio": round(masked_all / plain_all, 3),
        "mask_threads": args.mask_threads,
        "inline_mask_rows": args.inline_mask_rows,
        "cpu": cpu_model(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
