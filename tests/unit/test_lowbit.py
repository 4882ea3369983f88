"""Canteen's low-bit kernel (worker/kernels/lowbit.cpp): 4- and 8-bit weights as shipped times
bfloat16 activations as they are, on every instruction set it has a path for: each output is the
exact dot product up to float32 summation, and a row's bits never depend on the rows beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker import kernels
from worker.model.quant import (
    GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    Q8Groups,
    pack_groups,
    q4_from_float,
)


def setup_module() -> None:
    assert kernels.available(), "Canteen's CPU kernels did not build (is g++ installed?)"


def _weights(n: int, k: int, bits: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random q in the bit range (0..15, or -128..127), float16-exact d and m: w = d * q + m."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    d = (torch.rand(n, k // GROUP_SIZE, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // GROUP_SIZE, generator=g) * 0.1).half().float()
    return q, d, m


def _dequantized(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    w = q.view(n, -1, GROUP_SIZE).double() * d.double().unsqueeze(-1) + m.double().unsqueeze(-1)
    return w.view(n, k)


def _bound(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The size of the float32 sums behind each output: |x| times |d q| + |m|, per group."""
    return x.double().abs() @ _dequantized(q.to(torch.int16).abs(), d.abs(), m.abs()).T


def _exact(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float64 product of x as it is (bfloat16 values) and the dequantized weights."""
    return x.double() @ _dequantized(q, d, m).T


def _bfloat16_values(rows: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 576), (3, 40, 96), (13, 17, 32)])
def test_quant_linear_is_the_exact_product_up_to_float32_sums(
    bits: int, rows: int, n: int, k: int
) -> None:
    """float32 out (x's values bfloat16): every output is the float64 product of x and the
    dequantized weights within float32 summation error (1e-6 of the sums' size; rounding the
    activations to int8, as before, misses by 1e-3); n not a multiple of 16 pads a block."""
    q, d, m = _weights(n, k, bits, seed=rows)
    x = _bfloat16_values(rows, k, seed=9).float()
    bias = torch.randn(n)
    got = pack_groups(q, d, m, bits)(x, bias)
    want = _exact(x, q, d, m) + bias.double()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    err = (got.double() - want).abs()
    assert (err <= 1e-6 * _bound(x, q, d, m) + 1e-6).all(), err.max()


@pytest.mark.parametrize("bits", [4, 8])
def test_bfloat16_out_is_the_exact_product_rounded(bits: int) -> None:
    """bfloat16 in and out, as a decode step runs it: within one bfloat16 rounding of the exact
    product."""
    q, d, m = _weights(96, 576, bits, seed=3)
    x = _bfloat16_values(2, 576, seed=4)
    got = pack_groups(q, d, m, bits)(x, None)
    exact = _exact(x, q, d, m)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


def test_activations_are_not_rounded() -> None:
    """8-bit identity weights (q = 1 on the diagonal, d = 1, m = 0) hand back every activation
    as it came, the small ones beside a large one included (int8 rounding per group of 32
    would turn 0.001 next to 100 into 0)."""
    k = 64
    q = torch.eye(k, dtype=torch.int8)
    ones = torch.ones(k, k // GROUP_SIZE)
    values = [100.0, 1e-3, -2.5e-3, 3.140625, -0.5, 7e-5, 65280.0, -1.0]
    x = torch.tensor([*values, *([0.0] * (k - len(values)))]).bfloat16()
    got = pack_groups(q, ones, 0 * ones, 8)(x.unsqueeze(0), None)[0]
    assert torch.equal(got, x)


def test_a_zero_row_and_a_zero_group_give_exact_zeros_and_bias() -> None:
    q, d, m = _weights(32, 64, 4, seed=5)
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0  # the first group of row 1 is all zeros
    bias = torch.arange(32.0)
    got = pack_groups(q, d, m, 4)(x, bias)
    assert torch.equal(got[0], bias)
    want = _exact(x, q, d, m)[1] + bias.double()
    torch.testing.assert_close(got[1].double(), want, rtol=1e-6, atol=1e-5)


def test_quant_linear_refuses_what_it_cannot_compute() -> None:
    q, d, m = _weights(16, 64, 4, seed=6)
    packed = pack_groups(q, d, m, 4)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        packed(torch.zeros(1, 2, 64), None)
    with pytest.raises(RuntimeError, match="packed uint8"):
        packed(torch.zeros(1, 96), None)  # K of another layer
    with pytest.raises(RuntimeError, match="bias"):
        packed(torch.zeros(1, 64), torch.zeros(15))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_quant_linear_finishes_the_residual_add_and_silu_gate_bit_for_bit(
    bits: int, rows: int
) -> None:
    """As skinny_linear (test_kernels.py): a layer's linears fuse the same ops."""
    q, d, m = _weights(160, 96, bits, seed=bits + rows)
    packed = pack_groups(q, d, m, bits)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    bias = torch.randn(160, generator=g).bfloat16()
    ops = torch.ops.canteen
    plain = ops.quant_linear(x, packed.weights, packed.scales, 160, bias)
    gated = ops.quant_linear(x, packed.weights, packed.scales, 160, bias, None, True)
    assert gated.shape == (rows, 80) and torch.equal(gated, ops.silu_mul(plain))
    residual = torch.randn(rows, 160, generator=g).bfloat16()
    added = ops.quant_linear(x, packed.weights, packed.scales, 160, bias, residual)
    assert torch.equal(added, residual + plain)
    with pytest.raises(RuntimeError, match=r"residual \[M, N\]"):
        ops.quant_linear(x, packed.weights, packed.scales, 160, bias, residual.float())


@pytest.mark.parametrize("bits", [4, 8])
def test_every_row_is_computed_as_it_would_be_alone(bits: int) -> None:
    """Every row count from 1 to 64 (register tiles of 1-12 rows, blocks taken 1-4 at a
    time) gives each row the bits of a call of its own, with the residual add and the SiLU
    gate too (their tiles hold two blocks), and stays at the exact product."""
    q, d, m = _weights(160, 96, bits, seed=bits)
    packed = pack_groups(q, d, m, bits)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(64, 96, generator=g).bfloat16()
    bias = torch.randn(160, generator=g).bfloat16()
    residual = torch.randn(64, 160, generator=g).bfloat16()
    ops = torch.ops.canteen
    alone = torch.cat([ops.quant_linear(x[i : i + 1], packed.weights, packed.scales, 160, bias)
                       for i in range(64)])  # fmt: skip
    for rows in range(1, 65):
        got = ops.quant_linear(x[:rows], packed.weights, packed.scales, 160, bias)
        assert torch.equal(got, alone[:rows]), rows
    for rows in (1, 7, 13, 25, 64):
        added = ops.quant_linear(
            x[:rows], packed.weights, packed.scales, 160, bias, residual[:rows]
        )
        assert torch.equal(added, residual[:rows] + alone[:rows]), rows
        gated = ops.quant_linear(x[:rows], packed.weights, packed.scales, 160, bias, None, True)
        assert torch.equal(gated, ops.silu_mul(alone[:rows])), rows
    exact = _exact(x, q, d, m) + bias.double()
    torch.testing.assert_close(alone.double(), exact, rtol=2**-8, atol=1e-6)


def test_int4_layers_take_the_kernel_for_every_step() -> None:
    """Decode rows and a prompt's 40 rows alike get the exact product of the activations
    and the 4-bit values (their d and m exact in float16), rounded once to bfloat16."""
    torch.manual_seed(7)
    groups = q4_from_float(torch.randn(80, 128) * 0.05)
    layer = Int4Linear(groups, None)
    assert layer.packed is not None, "quant_linear is vectorized on every CPU CI runs on"
    x = torch.randn(40, 128).bfloat16()
    decode, prompt = layer(x[:3]), layer(x)
    q, d, m = groups.q, groups.d.half().float(), groups.m.half().float()
    torch.testing.assert_close(prompt.double(), _exact(x, q, d, m), rtol=2**-8, atol=1e-6)
    assert torch.equal(decode, prompt[:3])


def test_int8_layers_carry_a_files_q8_0_blocks_as_shipped() -> None:
    """Given Q8_0 groups (a GGUF's int8 and a float16 scale per 32 weights), the layer
    computes with exactly those; without, with one scale per row."""
    g = torch.Generator().manual_seed(8)
    q8 = Q8Groups(
        torch.randint(-128, 128, (48, 96), generator=g).to(torch.int8),
        (torch.rand(48, 3, generator=g) * 0.01).half().float(),
    )
    bias = torch.randn(48, generator=g)
    layer = Int8Linear(q8.dequantize(), bias, q8)
    assert layer.packed is not None and layer.bias is not None
    x = torch.randn(3, 96, generator=g).bfloat16()
    want = x.double() @ q8.dequantize().double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=2**-8, atol=1e-6)
    per_row = Int8Linear(q8.dequantize(), bias)
    w = per_row.weight.double() * per_row.scales.double().unsqueeze(1)
    want = x.double() @ w.T + layer.bias.double()
    torch.testing.assert_close(per_row(x).double(), want, rtol=2**-8, atol=1e-6)


# Each instruction-set path of lowbit.cpp, built for a CPU level this one runs (a subprocess:
# one process holds one build of the ops). The AVX512-BF16 path is the native build above.
ARCHES = {"avx2": "x86-64-v3", "plain": "x86-64"}
CHECK = """
import sys, torch
torch.ops.load_library(sys.argv[1])
from tests.unit.test_lowbit import _bfloat16_values, _bound, _exact, _weights
from worker.model.quant import pack_groups
assert torch.ops.canteen.quant_vectorized() == (sys.argv[2] == "avx2")
for bits in (4, 8):
    q, d, m = _weights(40, 96, bits, seed=bits)
    packed = pack_groups(q, d, m, bits)
    x = _bfloat16_values(30, 96, seed=1).float()
    got = packed(x, None).double()
    assert ((got - _exact(x, q, d, m)).abs() <= 1e-6 * _bound(x, q, d, m) + 1e-6).all(), bits
    alone = torch.cat([packed(x[i : i + 1], None) for i in range(30)])
    for rows in range(1, 31):
        assert torch.equal(packed(x[:rows], None), alone[:rows]), (bits, rows)
from worker.model.quant import pack_lanes  # and skinny_linear's bfloat16 path here
w = (torch.randn(50, 41, generator=torch.Generator().manual_seed(2)) * 0.1).bfloat16()
xb = torch.randn(5, 41, generator=torch.Generator().manual_seed(3)).bfloat16()
got = torch.ops.canteen.skinny_linear(xb, pack_lanes(w), 50, None)
torch.testing.assert_close(got, (xb.float() @ w.float().T).bfloat16(), atol=0, rtol=2**-7)
print("ok")
"""


@pytest.mark.skipif(
    "avx2" not in Path("/proc/cpuinfo").read_text(), reason="needs a CPU that runs AVX2 code"
)
@pytest.mark.parametrize("path", sorted(ARCHES))
def test_every_instruction_set_path_computes_the_same(path: str, tmp_path: Path) -> None:
    flags = tuple(f"-march={ARCHES[path]}" if f == "-march=native" else f for f in kernels.FLAGS)
    library = tmp_path / "ops.so"
    build = subprocess.run(
        kernels._compile_command(library, flags), capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stderr[-2000:]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(library), path],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
