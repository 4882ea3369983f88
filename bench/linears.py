"""A step's linears: Canteen's skinny_linear vs oneDNN's prepacked matmul vs F.linear.

Every linear of a SmolLM2 step (30 layers of qkv, o, gate-up and down, and the head), each
with weights of its own so that a pass reads them from memory as a step does, at each row
count of --rows, in float32 and bfloat16 (--dtypes). The kernels alternate pass by pass in
one process (the order reversed every other pass); the first pass of each is a warm-up.
Reports the median and the best pass in ms, and each side's median over Canteen's.

Canteen's kernel computes every row count in the default settings (a row's bits never
depend on the batch); oneDNN is what it replaced for steps past a few rows (prefill chunks,
wide batches), so the rows of a prefill (256, 512) belong in the comparison too.

In bfloat16, "int4" is quant_linear over 4-bit groups (the head 8-bit), the weights
`--quantization int4` serves, on the same rows.

Usage: python bench/linears.py [--rows 1,4,8,16,32,64] [--dtypes float32,bfloat16] [--passes 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from worker import kernels
from worker.model.quant import PackedLinear, can_pack, pack_groups, pack_lanes

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]

Pass = Callable[[dict[int, torch.Tensor]], None]


def sides(dtype: torch.dtype) -> dict[str, Pass]:
    """Each way of computing the step's linears, over the same weights."""
    weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in SHAPES]
    lanes = [pack_lanes(w) for w in weights]

    def canteen(xs: dict[int, torch.Tensor]) -> None:
        for (n, k), lane in zip(SHAPES, lanes, strict=True):
            torch.ops.canteen.skinny_linear(xs[k], lane, n, None)

    def flinear(xs: dict[int, torch.Tensor]) -> None:
        for (_, k), w in zip(SHAPES, weights, strict=True):
            F.linear(xs[k], w)

    out: dict[str, Pass] = {"canteen": canteen, "F.linear": flinear}
    if can_pack(weights[0]):
        packed = [PackedLinear(w, None).weight for w in weights]

        def onednn(xs: dict[int, torch.Tensor]) -> None:
            for (_, k), w in zip(SHAPES, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

        out["oneDNN"] = onednn
    if dtype == torch.bfloat16 and kernels.quant_vectorized():
        out["int4"] = _lowbit()
    return out


def _lowbit() -> Pass:
    """quant_linear over the GGUF's formats: 4-bit groups (Q4_1) for the layers and 8-bit
    (Q8_0) for the head, as `--quantization int4` serves SmolLM2's file."""
    g = torch.Generator().manual_seed(0)
    packed = []
    for n, k in SHAPES:
        bits = 8 if n == SHAPES[-1][0] else 4
        low, high = (0, 16) if bits == 4 else (-128, 128)
        q = torch.randint(low, high, (n, k), generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
        m = -8 * d if bits == 4 else torch.zeros_like(d)
        packed.append(pack_groups(q, d, m, bits))

    def int4(xs: dict[int, torch.Tensor]) -> None:
        for (n, k), p in zip(SHAPES, packed, strict=True):
            torch.ops.canteen.quant_linear(xs[k], p.weights, p.scales, n, None)

    return int4


def measure(side: dict[str, Pass], rows: int, dtype: torch.dtype, passes: int) -> None:
    xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
    times: dict[str, list[float]] = {name: [] for name in side}
    names = list(side)
    for i in range(passes + 1):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            side[name](xs)
            if i > 0:
                times[name].append((time.perf_counter() - start) * 1e3)
    base = statistics.median(times["canteen"])
    cells = []
    for name, t in times.items():
        median = statistics.median(t)
        cells.append(f"{name} {median:6.1f} (best {min(t):6.1f}, x{median / base:.2f})")
    print(f"  {str(dtype)[6:]:9s} rows {rows:3d}: " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--passes", type=int, default=8)
    args = parser.parse_args()
    if not kernels.available():
        sys.exit("Canteen's CPU kernels are not built: run `make install`")
    capability = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model()} ({capability}), torch {torch.__version__}, {threads} threads")
    print("ms per pass over a SmolLM2 step's 121 linears (median of passes), in the order run:")
    with torch.inference_mode():
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            side = sides(dtype)
            for rows in (int(r) for r in args.rows.split(",")):
                measure(side, rows, dtype, args.passes)


if __name__ == "__main__":
    main()
