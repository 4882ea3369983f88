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
@pytest.mark.parametrize("rank", [16, 32])  # 32: A in two tasks, z scaled after both
def test_the_bits_of_the_two_skinny_linears_it_replaces(
    dtype: torch.dtype, wide: int, rank: int
) -> None:
    x, y = _inputs(dtype, wide)
    adapters = [_adapter(rank, 1, 2.0, wide=wide), _adapter(8, 2, 0.75, 1, wide)]
    adapters.append(_adapter(4, 3, 1.5, wide=wide))
    got = _lora_add(y, x, GROUPS, adapters)
    assert torch.equal(got, _two_linears(y, x, GROUPS, adapters))
    assert torch.equal(got[8], y[8])  # a base row is left as it was
    assert not torch.equal(got[0], y[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rank", "wide"), [(16, 1), (5, 1), (16, 16), (32, 1), (32, 16)])
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


# The fused linears' addend (common.h, Finish): an adapter's delta added to a linear's own
# outputs before its residual add or SiLU gate, as stack.cpp's decode_layers runs a linear an
# adapter targets. Bit-equal to the unfused linear, ``y += delta`` and the op it feeds.

# N_OUT: [gate | up] of 80 each for the gate: torch's vectorized exp for the first 64, its
# scalar one after (common.h, torch_vector_end), as silu_mul computes them
K_IN, N_OUT = 96, 160
ADD_ROWS = [4, 0, 2]  # rows 1 and 3: the base's, no addend


def _linears(dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """skinny_linear's lanes and quant_linear's 4-bit (packed, scales) of one random weight."""
    from worker.model.quant import pack_groups, q4_from_float

    w = torch.randn(N_OUT, K_IN, generator=torch.Generator().manual_seed(5)) / K_IN**0.5
    q = q4_from_float(w)
    packed = pack_groups(q.q, q.d.half().float(), q.m.half().float(), 4)
    out = {"skinny": [pack_lanes(w.to(dtype))], "quant": [packed.weights, packed.scales]}
    return out


def _linear(kind: str, weights: list[torch.Tensor], x: torch.Tensor, **kw: object) -> torch.Tensor:
    op = torch.ops.canteen.skinny_linear if kind == "skinny" else torch.ops.canteen.quant_linear
    return op(x, *weights, N_OUT, None, **kw)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["skinny", "quant"])
@pytest.mark.parametrize("finish", ["plain", "residual", "gate"])
def test_a_fused_linears_addend_has_the_bits_of_the_unfused_add(
    dtype: torch.dtype, kind: str, finish: str
) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, K_IN, generator=gen).to(dtype)
    residual = torch.randn(5, N_OUT, generator=gen).to(dtype)
    addend = torch.randn(len(ADD_ROWS), N_OUT, generator=gen).to(dtype)
    rows = torch.tensor(ADD_ROWS, dtype=torch.long)
    weights = _linears(dtype)[kind]
    y = _linear(kind, weights, x)
    y[rows] = y[rows] + addend  # StepLora.apply's in-place add, row by row
    if finish == "plain":
        want = y
    elif finish == "residual":
        want = residual + y
    else:
        want = torch.ops.canteen.silu_mul(y)
    extra = {"residual": residual} if finish == "residual" else {"gate": finish == "gate"}
    got = _linear(kind, weights, x, addend=addend, addend_rows=rows, **extra)
    assert torch.equal(got, want)
    # no addend: the base rows' bits, whatever rows beside them have one
    alone = _linear(kind, weights, x, **extra)
    assert torch.equal(got[[1, 3]], alone[[1, 3]])


def test_an_addend_row_outside_the_step_or_twice_is_refused_naming_it() -> None:
    x = torch.randn(5, K_IN).to(torch.bfloat16)
    weights = _linears(torch.bfloat16)["skinny"]
    addend = torch.zeros(2, N_OUT, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="skinny_linear: addend row 5 outside x's 5 rows"):
        _linear("skinny", weights, x, addend=addend, addend_rows=torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="skinny_linear: addend row 2 given twice"):
        _linear("skinny", weights, x, addend=addend, addend_rows=torch.tensor([2, 2]))
    with pytest.raises(
        RuntimeError, match=r"quant_linear: addend \[R, N\] contiguous in x's dtype"
    ):
        quant = _linears(torch.bfloat16)["quant"]
        _linear("quant", quant, x, addend=addend.float(), addend_rows=torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_deltas_are_the_deltas_lora_add_adds(dtype: torch.dtype) -> None:
    """Row i of lora_deltas is listed row i's delta: adding it gives lora_add's bits; a part
    an adapter lacks is -0.0, which adds as nothing."""
    x, y = _inputs(dtype)
    rows = [r for g in GROUPS for r in g]
    deltas = torch.ops.canteen.lora_deltas(
        x,
        torch.tensor(rows, dtype=torch.long),
        [len(g) for g in GROUPS],
        torch.tensor([s for _, _, s in ADAPTERS], dtype=torch.float64),
        [a.shape[0] // len(PARTS) for a, _, _ in ADAPTERS],
        _weights(ADAPTERS, dtype),
        PARTS,
    )
    added = y.clone()
    added[rows] = added[rows] + deltas
    assert torch.equal(added, _lora_add(y, x, GROUPS, ADAPTERS))
    lacking = deltas[
        len(GROUPS[0]) : len(GROUPS[0]) + len(GROUPS[1]), PARTS[0] : PARTS[0] + PARTS[1]
    ]
    assert torch.equal(lacking.float().abs(), torch.zeros_like(lacking).float())
    assert bool(torch.signbit(lacking).all())
