"""canteen::lora_add (worker/kernels/lora.cpp): every adapter's delta on its own rows of one
linear in one call; the bits of the two skinny_linear calls it replaces, the same bits alone
and mixed, and float32 sums within reduction-order bounds of float64 (issue 35)."""

from __future__ import annotations

import pytest
import torch

from worker import kernels
from worker.model.quant import pack_lanes

pytestmark = pytest.mark.skipif(not kernels.available(), reason="Canteen's CPU kernels")

IN = 72
PARTS = [32, 16, 16]  # q | k | v
ROWS = 11

Adapter = tuple[torch.Tensor, list[torch.Tensor | None], float]  # A [P r, in], B_i [out_i, r]


def _adapter(rank: int, seed: int, scale: float, skip: int | None = None, wide: int = 1) -> Adapter:
    """``wide``: IN and PARTS times that (enough work for the kernel's threads)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(len(PARTS) * rank, IN * wide, generator=gen) / (IN * wide) ** 0.5
    b: list[torch.Tensor | None] = []
    for i, out in enumerate(p * wide for p in PARTS):
        if i == skip:  # an untargeted part: zero rows in A, no B
            a[i * rank : (i + 1) * rank] = 0
            b.append(None)
        else:
            b.append(torch.randn(out, rank, generator=gen))
    return a, b, scale


def _weights(adapters: list[Adapter], dtype: torch.dtype) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a, b, _ in adapters:
        out += [pack_lanes(a.to(dtype))]
        out += [torch.empty(0) if t is None else pack_lanes(t.to(dtype)) for t in b]
    return out


def _lora_add(
    y: torch.Tensor, x: torch.Tensor, groups: list[list[int]], adapters: list[Adapter]
) -> torch.Tensor:
    y, parts = y.clone(), [p * y.shape[1] // sum(PARTS) for p in PARTS]
    torch.ops.canteen.lora_add(
        y,
        x,
        torch.tensor([r for g in groups for r in g], dtype=torch.long),
        [len(g) for g in groups],
        torch.tensor([s for _, _, s in adapters], dtype=torch.float64),
        [a.shape[0] // len(PARTS) for a, _, _ in adapters],
        _weights(adapters, x.dtype),
        parts,
    )
    return y


def _two_linears(
    y: torch.Tensor, x: torch.Tensor, groups: list[list[int]], adapters: list[Adapter]
) -> torch.Tensor:
    """The former path: skinny_linear(A) * scale, then skinny_linear of the block-diagonal B
    [out, P r] onto the rows' y, per adapter."""
    y = y.clone()
    for rows, (a, b, scale) in zip(groups, adapters, strict=True):
        rank, ix = a.shape[0] // len(PARTS), torch.tensor(rows, dtype=torch.long)
        block = torch.zeros(y.shape[1], a.shape[0])
        at = 0
        sizes = [p * y.shape[1] // sum(PARTS) for p in PARTS]
        for i, (t, out) in enumerate(zip(b, sizes, strict=True)):
            if t is not None:
                block[at : at + out, i * rank : (i + 1) * rank] = t
            at += out
        n = a.shape[0]
        z = torch.ops.canteen.skinny_linear(x[ix], pack_lanes(a.to(x.dtype)), n, None)
        z = z * torch.tensor(scale, dtype=x.dtype)
        lanes = pack_lanes(block.to(x.dtype))
        y[ix] = torch.ops.canteen.skinny_linear(z, lanes, y.shape[1], None, y[ix].contiguous())
    return y


def _inputs(dtype: torch.dtype, wide: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN * wide, generator=gen).to(dtype)
    y = torch.randn(ROWS, sum(PARTS) * wide, generator=gen).to(dtype)
    return x, y


ADAPTERS = [_adapter(16, 1, 2.0), _adapter(8, 2, 0.75, skip=1), _adapter(4, 3, 1.5)]
GROUPS = [[0, 3, 4, 9, 10], [1, 7], [2, 5, 6]]  # row 8: the base's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wide", [1, 16])
def test_the_bits_of_the_two_skinny_linears_it_replaces(dtype: torch.dtype, wide: int) -> None:
    x, y = _inputs(dtype, wide)
    adapters = [_adapter(16, 1, 2.0, wide=wide), _adapter(8, 2, 0.75, 1, wide)]
    adapters.append(_adapter(4, 3, 1.5, wide=wide))
    got = _lora_add(y, x, GROUPS, adapters)
    assert torch.equal(got, _two_linears(y, x, GROUPS, adapters))
    assert torch.equal(got[8], y[8])  # a base row is left as it was
    assert not torch.equal(got[0], y[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rank", "wide"), [(16, 1), (5, 1), (16, 16)])
def test_an_adapters_rows_get_the_same_bits_alone_and_mixed(
    dtype: torch.dtype, rank: int, wide: int
) -> None:
    """wide=16: the mixed call shares its work among threads, a single row's call does not."""
    x, y = _inputs(dtype, wide)
    adapters = [_adapter(rank, 4, 2.0, wide=wide), _adapter(8, 2, 0.75, 1, wide)]
    adapters.append(_adapter(4, 3, 1.5, wide=wide))
    mixed = _lora_add(y, x, GROUPS, adapters)
    for g, rows in enumerate(GROUPS):
        for alone in ([rows], [rows[:1]], [rows[1:]]):  # fewer rows beside it: same bits
            got = _lora_add(y, x, alone, [adapters[g]])
            ix = torch.tensor(alone[0], dtype=torch.long)
            assert torch.equal(got[ix], mixed[ix]), (g, alone)


def test_float32_is_within_float32_rounding_of_float64() -> None:
    x, y = _inputs(torch.float32)
    got = _lora_add(y, x, GROUPS, ADAPTERS)
    want = y.double().clone()
    for rows, (a, b, scale) in zip(GROUPS, ADAPTERS, strict=True):
        rank = a.shape[0] // len(PARTS)
        z = x[rows].double() @ a.double().T * scale
        at = 0
        for i, (t, out) in enumerate(zip(b, PARTS, strict=True)):
            if t is not None:
                want[rows, at : at + out] += z[:, i * rank : (i + 1) * rank] @ t.double().T
            at += out
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got.double(), y.double(), rtol=1e-2, atol=1e-2)


def test_a_wrong_layout_is_refused_naming_it() -> None:
    x, y = _inputs(torch.float32)
    weights = _weights(ADAPTERS[:1], torch.float32)
    weights[1] = weights[1][:, :-1].contiguous()  # q's B with one rank column too few
    with pytest.raises(RuntimeError, match="adapter 0 weight 1 is not pack_lanes' layout"):
        torch.ops.canteen.lora_add(
            y, x, torch.tensor([0]), [1], torch.tensor([1.0], dtype=torch.float64), [16],
            weights, PARTS,
        )  # fmt: skip


def test_a_row_outside_the_step_is_refused_naming_it() -> None:
    x, y = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match=f"lora_add: row {ROWS} outside x's {ROWS} rows"):
        torch.ops.canteen.lora_add(
            y, x, torch.tensor([ROWS]), [1], torch.tensor([1.0], dtype=torch.float64), [16],
            _weights(ADAPTERS[:1], torch.float32), PARTS,
        )  # fmt: skip
