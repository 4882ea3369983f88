"""The worker's step on two revisions of the code, side by side in one run.

Checks ``--base`` (a git revision) out into a temporary worktree and times the same probe
(bench/step_probe.py) on it and on this tree, each in a process of its own that loads
SmolLM2 with the default settings (``--dtype auto``, no quantization; --dtype and
--quantization change them), alternating which side goes first every round, and prints
every round in the order it ran. The probe times a decode step at each batch of --batches
(ms per step, so tokens per second is batch / step) and the prefill of one --prompt-token
prompt in chunks of the default max_batched_tokens (2,048). Both sides build their own CPU
kernels first (not timed) and neither has a cache the other lacks.

Usage: python bench/revisions.py --base cee0cb6 [--rounds 3] [--batches 1,16,32]
       [--prompt 2000] [--quantization none]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "bench" / "step_probe.py"


def run_probe(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(PROBE), "--batches", args.batches, "--prompt", str(args.prompt)]
    cmd += ["--quantization", args.quantization, "--steps", str(args.steps), "--dtype", args.dtype]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"probe failed on {tree}:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def build_kernels(tree: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(
        [sys.executable, "-m", "worker.kernels"], cwd=tree, env=env, check=True, capture_output=True
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--dtype", default="auto", help="the worker's --dtype (default: auto)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base],
            check=True,
        )
        try:
            compare(base, args)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
            )


def compare(base: Path, args: argparse.Namespace) -> None:
    sides = {"base": base, "this": ROOT}
    for tree in sides.values():
        build_kernels(tree)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    print(f"CPU: {cpu}; base {args.base} vs this tree; --dtype {args.dtype}, ", end="")
    print(f"--quantization {args.quantization}; ms")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            got = run_probe(sides[name], args)
            results[name].append(got)
            cells = " | ".join(f"{k} {v:.1f}" for k, v in got.items())
            print(f"  round {r} {name:4s}: {cells}", flush=True)
    print("median this / base (below 1: this is faster):")
    for key in results["this"][0]:
        this = statistics.median(x[key] for x in results["this"])
        was = statistics.median(x[key] for x in results["base"])
        print(f"  {key}: {this:.1f} / {was:.1f} = {this / was:.2f}")


if __name__ == "__main__":
    main()
