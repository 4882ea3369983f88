"""Canteen's low-bit kernel (worker/kernels/lowbit.cpp): 4- and 8-bit weights against int8
activations, on every instruction set it has a path for."""

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
    pack_groups,
    q4_from_float,
)


def setup_module() -> None:
    assert kernels.available(), "Canteen's CPU kernels did not build (is g++ installed?)"


def _weights(n: int, k: int, bits: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random u in the bit range, float16-exact d and m: w = d * u + m."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), generator=g).to(torch.uint8)
    d = (torch.rand(n, k // GROUP_SIZE, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // GROUP_SIZE, generator=g) * 0.1).half().float()
    return u, d, m


def _dequantized(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = u.shape
    w = u.view(n, -1, GROUP_SIZE).double() * d.double().unsqueeze(-1) + m.double().unsqueeze(-1)
    return w.view(n, k)


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: per group of 32, int8 with scale max|x| / 127."""
    groups = x.float().view(x.shape[0], -1, GROUP_SIZE)
    top = groups.abs().amax(-1, keepdim=True)
    q = torch.where(top > 0, (groups * (127 / top)).round(), 0.0)
    return (q.double() * (top.double() / 127)).view(x.shape)


def _reference(x: torch.Tensor, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _int8_activations(x) @ _dequantized(u, d, m).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 576), (3, 40, 96), (8, 17, 32)])
def test_quant_linear_is_the_int8_activation_dot_product(
    bits: int, rows: int, n: int, k: int
) -> None:
    """Every output equals the dot product of the int8-rounded activations with the exact
    low-bit weights, up to float32 summation order; n not a multiple of 16 pads a block."""
    u, d, m = _weights(n, k, bits, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    bias = torch.randn(n)
    got = pack_groups(u, d, m, bits)(x, bias)
    want = _reference(x, u, d, m) + bias.double()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_stays_close_to_the_unrounded_activations(bits: int) -> None:
    """bfloat16 in and out, as a decode step runs it: int8 activations cost well under 1% of
    the output's scale against the exact weights times the exact activations."""
    u, d, m = _weights(96, 576, bits, seed=3)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = pack_groups(u, d, m, bits)(x, None)
    exact = x.double() @ _dequantized(u, d, m).T
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).abs().max() < 0.01 * exact.abs().max()


def test_a_zero_row_and_a_zero_group_give_exact_zeros_and_bias() -> None:
    u, d, m = _weights(32, 64, 4, seed=5)
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0  # the first group of row 1 is all zeros: its scale must not divide by 0
    bias = torch.arange(32.0)
    got = pack_groups(u, d, m, 4)(x, bias)
    assert torch.equal(got[0], bias)
    want = _reference(x, u, d, m)[1] + bias.double()
    torch.testing.assert_close(got[1].double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_round_half_to_even_as_torch_does(dtype: torch.dtype) -> None:
    """8-bit identity weights (w = 1 * u - 128, u = 129 on the diagonal) hand back each
    activation as the kernel rounded it. With max|x| = 127 the scale is 1, so the halves
    land exactly between two int8 values and must round to even, as torch.round does (the
    vectorized rounding and the scalar loop agree on every input)."""
    k = 32
    u = torch.full((k, k), 128, dtype=torch.uint8)
    u.fill_diagonal_(129)
    ones = torch.ones(k, k // GROUP_SIZE)
    halves = [2.5, -2.5, 3.5, 0.5, -0.5, 1.5, -1.5, 4.5, -126.5, 126.5, 5.25, -5.75]
    x = torch.tensor([127.0, *halves, *([0.0] * (k - 1 - len(halves)))]).to(dtype)
    got = pack_groups(u, ones, -128 * ones, 8)(x.unsqueeze(0), None)[0]
    assert got.dtype == dtype
    assert got.float().tolist() == torch.round(x.float()).tolist()
    assert got[1:5].float().tolist() == [2.0, -2.0, 4.0, 0.0]


def test_quant_linear_refuses_what_it_cannot_compute() -> None:
    u, d, m = _weights(16, 64, 4, seed=6)
    packed = pack_groups(u, d, m, 4)
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
    """As skinny_linear (test_kernels.py): a draft model's layers fuse the same ops."""
    u, d, m = _weights(160, 96, bits, seed=bits + rows)
    packed = pack_groups(u, d, m, bits)
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
    """quant_linear takes rows eight at a time against each block of weights: 1, 8, 9, 20
    and 64 rows give each row the bits of a call of its own (batched equals alone), with the
    residual add and the SiLU gate too, and stay near the exact product."""
    u, d, m = _weights(160, 96, bits, seed=bits)
    packed = pack_groups(u, d, m, bits)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(64, 96, generator=g).bfloat16()
    bias = torch.randn(160, generator=g).bfloat16()
    residual = torch.randn(64, 160, generator=g).bfloat16()
    ops = torch.ops.canteen
    alone = torch.cat([ops.quant_linear(x[i : i + 1], packed.weights, packed.scales, 160, bias)
                       for i in range(64)])  # fmt: skip
    for rows in (1, 8, 9, 20, 64):
        got = ops.quant_linear(x[:rows], packed.weights, packed.scales, 160, bias)
        assert torch.equal(got, alone[:rows]), rows
        added = ops.quant_linear(
            x[:rows], packed.weights, packed.scales, 160, bias, residual[:rows]
        )
        assert torch.equal(added, residual[:rows] + alone[:rows]), rows
        gated = ops.quant_linear(x[:rows], packed.weights, packed.scales, 160, bias, None, True)
        assert torch.equal(gated, ops.silu_mul(alone[:rows])), rows
    exact = x.double() @ _dequantized(u, d, m).T + bias.double()
    assert (alone.double() - exact).abs().max() < 0.02 * exact.abs().max()


def test_int4_layers_take_the_kernel_for_every_step() -> None:
    """Decode rows and a prompt's 40 rows alike get the kernel's answer (int8 activations
    times the exact 4-bit values), near the weights times the activations."""
    torch.manual_seed(7)
    weight = torch.randn(80, 128) * 0.05
    groups = q4_from_float(weight)
    layer = Int4Linear(groups, None)
    assert layer.packed is not None, "quant_linear is vectorized on every CPU CI runs on"
    x = torch.randn(40, 128).bfloat16()
    exact = x.double() @ groups.dequantize().double().T
    decode, prompt = layer(x[:3]), layer(x)
    q, d, m = groups.q, groups.d.half().float(), groups.m.half().float()
    want = _reference(x, q, d, m).to(torch.bfloat16)
    torch.testing.assert_close(prompt, want, rtol=2**-7, atol=2**-8)  # a bfloat16 ulp at 0.5
    assert torch.equal(decode, prompt[:3])
    assert (prompt.double() - exact).abs().max() < 0.02 * exact.abs().max()


def test_int8_layers_carry_their_weights_exactly_into_the_kernel() -> None:
    """Int8Linear's row scale and int8 weights become u = q + 128, d = scale, m = -128 d:
    the kernel's answer is the int8 weights times the int8-rounded activations."""
    torch.manual_seed(8)
    layer = Int8Linear(torch.randn(48, 96), torch.randn(48))
    assert layer.packed is not None and layer.bias is not None
    x = torch.randn(3, 96).bfloat16()
    w = layer.weight.double() * layer.scales.double().unsqueeze(1)
    want = _int8_activations(x) @ w.T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=2**-7, atol=2e-3)


# Each instruction-set path of lowbit.cpp, built for a CPU level this one runs (a subprocess:
# one process holds one build of the ops).
ARCHES = {"avx2": "x86-64-v3", "plain": "x86-64"}
CHECK = """
import sys, torch
torch.ops.load_library(sys.argv[1])
from tests.unit.test_lowbit import _reference, _weights
from worker.model.quant import pack_groups
assert torch.ops.canteen.quant_vectorized() == (sys.argv[2] == "avx2")
for bits in (4, 8):
    u, d, m = _weights(40, 96, bits, seed=bits)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(1))  # 8 rows, then 3
    got = pack_groups(u, d, m, bits)(x, None).double()
    want = _reference(x, u, d, m)
    assert (got - want).abs().max() <= 2e-5 * want.abs().max(), (bits, got, want)
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
