"""Canteen's C++ CPU kernels (worker/kernels/) against the torch ops they replace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from worker import kernels
from worker.attention.interface import DecodeGroup
from worker.attention.paged import _decode


def setup_module() -> None:
    # make install builds the kernels with the machine's g++: without them these tests fail
    assert kernels.available(), "Canteen's CPU kernels did not build (is g++ installed?)"


BLOCK = 4


def _group(tables: list[list[int]], lens: list[int]) -> DecodeGroup:
    """A decode group as worker/attention/batch.py builds it: tables padded with block 0."""
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = (block_tables.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).flatten(-2)
    lengths = torch.tensor(lens)
    mask = torch.arange(width * BLOCK).unsqueeze(0) < lengths.unsqueeze(1)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    return DecodeGroup(
        index=torch.arange(len(tables)),
        block_tables=block_tables,
        mask=mask[:, None, None, :],
        slots=slots.flatten(),
        bias=bias.unsqueeze(1),
        lens=lengths,
    )


def _kernel(pool: torch.Tensor, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """The rows of ``group`` in the order of its index, as paged_attention writes them."""
    out = torch.full((q.shape[0] + 1, q.shape[1] * q.shape[2]), 7.0, dtype=q.dtype)
    slots = group.slots.view(len(group.lens), -1)
    index = group.index + 1  # rows of a bigger step: the kernel writes only these
    padded = torch.cat([torch.zeros_like(q[:1]), q])
    torch.ops.canteen.paged_decode_into(out, padded, pool, slots, group.lens, index, 0.25)
    assert torch.all(out[0] == 7.0)
    return out[1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 24, 64, 128])  # 24: not whole vectors (the scalar path)
def test_paged_decode_equals_the_gathering_torch_path(dtype: torch.dtype, dim: int) -> None:
    torch.manual_seed(0)
    heads, kv_heads, blocks = 6, 2, 12
    pool = torch.randn(2, kv_heads, blocks * BLOCK, dim).to(dtype)
    # rows of different lengths, tables in any block order, the last one a partial block;
    # the last row is longer than 16 positions and not a multiple of 16
    tables = [[3, 7, 1], [5], [11, 2, 9, 4], [0, 6, 8, 10, 3, 7, 1, 5, 11, 2, 9]]
    group = _group(tables, [11, 2, 16, 43])
    q = torch.randn(4, heads, dim).to(dtype)
    got = _kernel(pool, q, group)
    want = _decode(pool, q, group, 0.25)
    assert got.dtype == dtype and got.shape == (4, heads * dim)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one output rounding: at most one bfloat16 step apart (measured: 2**-9 at most)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=2**-7)
    # padding never counts: garbage in every slot past each row's length changes nothing
    used = torch.zeros(blocks * BLOCK, dtype=torch.bool)
    for row, n in enumerate(group.lens.tolist()):
        used[group.slots.view(4, -1)[row, :n]] = True
    pool[:, :, ~used] = 1e4
    assert torch.equal(_kernel(pool, q, group), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [24, 64])
def test_a_query_gets_the_same_bits_alone_in_a_prefill_chunk_or_among_other_rows(
    dtype: torch.dtype, dim: int
) -> None:
    """One kernel for every query: a token's attention is the same bits computed as a decode
    row alone, as one of a prefill chunk's queries sharing its sequence's slot table (keys
    written this step or long cached are all read from the pool), and among other sequences'
    rows of any width."""
    g = torch.Generator().manual_seed(dim)
    heads, kv_heads, slots_in_pool = 6, 2, 400
    pool = torch.randn(2, kv_heads, slots_in_pool, dim, generator=g).to(dtype)
    table = torch.randperm(slots_in_pool, generator=g)[:90].view(1, -1)  # scattered slots
    q = torch.randn(70, heads, dim, generator=g).to(dtype)
    attend = torch.ops.canteen.paged_decode_into

    def alone(row: int, length: int) -> torch.Tensor:
        out = torch.zeros(70, heads * dim, dtype=dtype)
        attend(out, q, pool, table, torch.tensor([length]), torch.tensor([row]), 0.125)
        return out[row]

    # a chunk of 50 queries after 40 cached positions: query i sees positions 0..40 + i
    chunk = torch.zeros(70, heads * dim, dtype=dtype)
    rows, lens = torch.arange(50), torch.arange(41, 91)
    attend(chunk, q, pool, table, lens, rows, 0.125, torch.zeros(50, dtype=torch.long))
    for i in range(50):
        assert torch.equal(chunk[i], alone(i, 41 + i)), i
    # the same chunk beside 20 decode rows of other sequences (tables 1..20), in one call
    others = torch.randint(0, slots_in_pool, (20, 90), generator=g)
    tables = torch.cat([table, others])
    mixed = torch.zeros(70, heads * dim, dtype=dtype)
    every_row, every_len = torch.arange(70), torch.cat([lens, torch.randint(1, 91, (20,))])
    which = torch.cat([torch.zeros(50, dtype=torch.long), torch.arange(1, 21)])
    attend(mixed, q, pool, tables, every_len, every_row, 0.125, which)
    assert torch.equal(mixed[:50], chunk[:50])


@pytest.mark.parametrize(
    ("lens", "rows", "error"),
    [([3], [0], "lens out of range"), ([2], [1], "rows out of range"), ([2], [0], "slots out")],
)
def test_paged_decode_refuses_indices_out_of_range(
    lens: list[int], rows: list[int], error: str
) -> None:
    pool, out = torch.zeros(2, 1, 8, 4), torch.zeros(1, 4)
    slots = torch.tensor([[0, 8]])  # slot 8 is past the pool's 8
    with pytest.raises(RuntimeError, match=error):
        torch.ops.canteen.paged_decode_into(
            out, torch.zeros(1, 1, 4), pool, slots, torch.tensor(lens), torch.tensor(rows), 1.0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_rms_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96)
    norm = norm.to(dtype)
    x = (torch.randn(7, 3, 96) * 4).to(dtype)
    got = torch.ops.canteen.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:
        assert torch.equal(got, norm(x))  # every rounding where transformers rounds
    else:
        torch.testing.assert_close(got, norm(x), atol=2e-6, rtol=2e-6)  # the sum's order


def test_without_a_compiler_the_worker_keeps_pure_torch(tmp_path: Path) -> None:
    env = {**os.environ, "CANTEEN_KERNEL_DIR": str(tmp_path), "CXX": "/bin/false"}
    code = "from worker import kernels; print(kernels.available())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
    assert "CPU kernels unavailable; using the pure-torch path" in done.stdout + done.stderr
    assert list(tmp_path.glob("*.so")) == []


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 200, 72),
        (2, 200, 72),
        (5, 200, 72),
        (3, 7, 9),
        (8, 333, 576),
        (12, 50, 40),
        (4, 16, 2),
        # AMX tiles (where the CPU has AMX and K is a multiple of 32): one and two tiles of
        # rows, N past whole groups of four and two blocks
        (1, 333, 576),
        (13, 333, 576),
        (16, 72, 64),
        (17, 333, 576),
        (32, 50, 96),
        # past a register tile (12 rows) or two tiles of AMX rows (32): prefill chunks
        (13, 200, 72),
        (33, 50, 96),
        (70, 333, 576),
        (300, 64, 40),
    ],
)
def test_skinny_linear_is_the_bfloat16_matmul(rows: int, n: int, k: int) -> None:
    """Any number of rows through Canteen's kernel: float32 sums of bfloat16 products, like
    oneDNN's, so the outputs agree up to the rounding of a differently ordered sum. N not a
    multiple of 16 (nor of the blocks the kernel takes at once) and an odd K included."""
    from worker.model.quant import LanesLinear, make_linear, pack_lanes

    torch.manual_seed(2)
    weight = (torch.randn(n, k) * 0.1).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    want = (x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)
    got = torch.ops.canteen.skinny_linear(x, pack_lanes(weight), n, bias)
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)  # at most one bfloat16 step
    plain = torch.ops.canteen.skinny_linear(x, pack_lanes(weight), n, None)
    torch.testing.assert_close(
        plain, (x.float() @ weight.float().T).to(torch.bfloat16), atol=0, rtol=2**-7
    )
    layer = make_linear(weight, bias, "none")
    assert isinstance(layer, LanesLinear) and torch.equal(layer(x), got)  # the default path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [576, 1536, 40])  # SmolLM2's two inputs; 40: never AMX tiles
def test_each_rows_outputs_are_its_own_whatever_the_batch(dtype: torch.dtype, k: int) -> None:
    """A row's sums do not depend on the rows beside it: a row computed alone gets the same
    bits as among 1..64 other rows, and in a 300-row prefill chunk (oneDNN's differ by
    shape)."""
    from worker.model.quant import pack_lanes

    g = torch.Generator().manual_seed(k)
    weight = torch.randn(100, k, generator=g).to(dtype)
    x = torch.randn(300, k, generator=g).to(dtype)
    lanes = pack_lanes(weight)
    linear = torch.ops.canteen.skinny_linear
    alone = torch.cat([linear(x[r : r + 1], lanes, 100, None) for r in range(300)])
    for rows in (*range(2, 66), 300):
        assert torch.equal(linear(x[:rows], lanes, 100, None), alone[:rows]), rows


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 864, 576),
        (2, 200, 72),
        (3, 7, 9),
        (6, 333, 77),
        (7, 50, 40),
        (16, 3072, 64),
        (64, 40, 1536),
    ],
)
def test_float32_skinny_linear_is_the_float32_matmul(rows: int, n: int, k: int) -> None:
    """float32 rows through dense_float.cpp: each output one fused multiply-add per weight,
    along K in order, so within a few float32 roundings of the exact product (computed in
    float64); N past whole blocks and register tiles, odd K, rows past one tile included."""
    from worker.model.quant import LanesLinear, make_linear, pack_lanes

    torch.manual_seed(rows)
    weight, bias, x = torch.randn(n, k) * 0.1, torch.randn(n), torch.randn(rows, k)
    lanes = pack_lanes(weight)
    assert lanes.shape == (-(-n // 16), k, 16, 1)
    exact = x.double() @ weight.double().T
    got = torch.ops.canteen.skinny_linear(x, lanes, n, bias)
    # a sum of k products in float32: error at most ~k ulps of the terms' magnitude
    bound = k * 2**-24 * (x.abs().double() @ weight.abs().double().T)
    assert ((got.double() - (exact + bias.double())).abs() <= bound + 2**-23).all()
    plain = torch.ops.canteen.skinny_linear(x, lanes, n, None)
    assert ((plain.double() - exact).abs() <= bound).all()
    layer = make_linear(weight, bias, "none")
    assert isinstance(layer, LanesLinear) and torch.equal(layer(x), got)  # the default path


def test_skinny_linear_refuses_what_it_cannot_compute() -> None:
    from worker.model.quant import pack_lanes

    lanes = pack_lanes(torch.randn(20, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x bfloat16 or float32"):
        torch.ops.canteen.skinny_linear(x.half(), lanes, 20, None)
    with pytest.raises(RuntimeError, match=r"lanes float32 \[ceil\(N / 16\), K, 16, 1\]"):
        torch.ops.canteen.skinny_linear(x.float(), lanes, 20, None)  # bfloat16's layout
    with pytest.raises(RuntimeError, match="for x's K"):
        torch.ops.canteen.skinny_linear(torch.randn(2, 96).bfloat16(), lanes, 20, None)
    with pytest.raises(RuntimeError, match="for x's K"):
        torch.ops.canteen.skinny_linear(x, lanes, 40, None)  # another layer's N
    with pytest.raises(RuntimeError, match=r"bias \[N\]"):
        torch.ops.canteen.skinny_linear(x, lanes, 20, torch.zeros(21))
    assert torch.ops.canteen.skinny_linear(x[:0], lanes, 20, None).shape == (0, 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "k"),
    [(1, 72), (5, 72), (12, 72), (1, 96), (16, 96), (17, 96), (32, 96), (45, 72), (80, 96)],
)  # K = 96: AMX tiles; 45 and 80 rows: several register tiles, or passes of AMX rows
def test_a_linear_finishes_the_residual_add_and_silu_gate_bit_for_bit(
    rows: int, k: int, dtype: torch.dtype
) -> None:
    """decode_layers lets the linears finish the ops after them: ``x + o_proj(a)`` and
    ``silu_mul(gate_up_proj(h))`` come out of skinny_linear with the bits of the separate
    ops. 80 gate outputs: 64 whose exp torch computes vectorized, 16 on its scalar tail, and
    an odd count of gate blocks (the up half starts mid-task)."""
    from worker.model.quant import pack_lanes

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    gate_up = (torch.randn(160, k, generator=g) * 0.3).to(dtype)
    bias = torch.randn(160, generator=g).to(dtype)
    lanes = pack_lanes(gate_up)
    ops = torch.ops.canteen
    want = ops.silu_mul(ops.skinny_linear(x, lanes, 160, bias))
    got = ops.skinny_linear(x, lanes, 160, bias, None, True)
    assert got.shape == (rows, 80) and torch.equal(got, want)
    residual = torch.randn(rows, 160, generator=g).to(dtype)
    added = ops.skinny_linear(x, lanes, 160, bias, residual)
    assert torch.equal(added, residual + ops.skinny_linear(x, lanes, 160, bias))


def test_a_fused_finish_refuses_what_it_cannot_compute() -> None:
    from worker.model.quant import pack_lanes

    x, ops = torch.randn(2, 64).bfloat16(), torch.ops.canteen
    lanes = pack_lanes(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="each a multiple of 16, got 48"):
        ops.skinny_linear(x, lanes, 48, None, None, True)  # 24 gate outputs: not whole blocks
    with pytest.raises(RuntimeError, match=r"residual \[M, N\]"):
        ops.skinny_linear(x, lanes, 48, None, torch.zeros(2, 47).bfloat16())
    with pytest.raises(RuntimeError, match="a residual or a gate, not both"):
        lanes64 = pack_lanes(torch.randn(64, 64).bfloat16())
        ops.skinny_linear(x, lanes64, 64, None, torch.zeros(2, 64).bfloat16(), True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64])  # 64: whole vectors in each half (bfloat16's own path)
def test_rotary_and_silu_gate_round_where_torch_rounds(dtype: torch.dtype, dim: int) -> None:
    """The fused rotary and SiLU gate give worker/model/forward.py's torch ops' values bit for bit:
    rotary the same products and sum, each rounded to the dtype; the gate torch's own exp
    (SLEEF's where torch's silu runs vectorized, std::exp on the tail of a row), at widths
    with and without a tail."""
    from worker.model.forward import _rotate

    torch.manual_seed(3)
    tokens, heads, kv_heads = 5, 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    cos, sin = torch.randn(tokens, 1, dim).to(dtype), torch.randn(tokens, 1, dim).to(dtype)
    view = qkv.view(tokens, -1, dim)
    want = _rotate(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    q = torch.ops.canteen.rotary(view, heads, cos, sin)
    k = torch.ops.canteen.rotary(view[:, heads:], kv_heads, cos, sin)
    assert torch.equal(q, want[:, :heads]) and torch.equal(k, want[:, heads:])
    for rows, inner in ((tokens, 40), (1, 1536), (16, 1536), (3, 100)):
        gate_up = (torch.randn(rows, 2 * inner) * 3).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        got = torch.ops.canteen.silu_mul(gate_up)
        assert torch.equal(got, torch.nn.functional.silu(gate) * up), (rows, inner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64])
def test_rotary_kv_writes_what_rotary_and_index_copy_write(dtype: torch.dtype, dim: int) -> None:
    """decode_layers' one pass over the QKV output: the rotated queries it returns, and the
    rotated keys and the values it writes into the pool, are rotary's and index_copy_'s bit
    for bit; no other slot changes, and a slot past the pool is refused before any write."""
    from worker.model.forward import _rotate

    torch.manual_seed(5)
    tokens, heads, kv_heads, slots = 3, 6, 2, 40
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim).to(dtype)
    cos, sin = torch.randn(tokens, 1, dim).to(dtype), torch.randn(tokens, 1, dim).to(dtype)
    pool = torch.randn(2, kv_heads, slots, dim).to(dtype)
    slot_mapping = torch.tensor([17, 3, 38])
    want_pool = pool.clone()
    rotated = _rotate(qkv[:, : heads + kv_heads], cos, sin)
    want_pool[0].index_copy_(1, slot_mapping, rotated[:, heads:].transpose(0, 1))
    want_pool[1].index_copy_(1, slot_mapping, qkv[:, heads + kv_heads :].transpose(0, 1))
    q = torch.ops.canteen.rotary_kv(qkv, heads, kv_heads, cos, sin, pool, slot_mapping)
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(pool, want_pool)
    with pytest.raises(RuntimeError, match="rotary_kv: slot 40 out of range"):
        torch.ops.canteen.rotary_kv(qkv, heads, kv_heads, cos, sin, pool, torch.tensor([1, 40, 2]))
    assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_greedy_pick_is_torchs_max_and_logsumexp(rows: int) -> None:
    """The sampler's one-pass kernel picks torch.max's value and first index (ties included)
    and torch.logsumexp's value within float32 rounding of the sum's order."""
    torch.manual_seed(rows)
    logits = (torch.randn(rows, 49152) * 3).bfloat16().float()
    logits[0, 7] = logits[0, 4000] = 40.0  # a tie: the first index wins
    best, chosen, norm = torch.ops.canteen.greedy_pick(logits, True)
    want_best, want_chosen = logits.max(dim=-1)
    assert torch.equal(best, want_best) and torch.equal(chosen, want_chosen)
    assert chosen[0].item() == 7
    torch.testing.assert_close(norm, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
    _, alone, none = torch.ops.canteen.greedy_pick(logits, False)
    assert torch.equal(alone, want_chosen) and none.numel() == 0
    # bfloat16 logits (what a bfloat16 lm_head makes) give the float32 copy's answers exactly
    wide = torch.ops.canteen.greedy_pick(logits.bfloat16(), True)
    assert all(torch.equal(a, b) for a, b in zip(wide, (best, chosen, norm), strict=True))
    assert wide[0].dtype == wide[2].dtype == torch.float32


def test_greedy_pick_keeps_torchs_answers_for_nan_and_infinite_rows() -> None:
    logits = torch.full((3, 40), float("-inf"))  # row 0: every token masked
    logits[1, 3] = logits[1, 20] = float("nan")
    logits[2, 35] = float("inf")
    best, chosen, norm = torch.ops.canteen.greedy_pick(logits, True)
    want_best, want_chosen = logits.max(dim=-1)
    assert chosen.tolist() == want_chosen.tolist() == [0, 3, 35]
    torch.testing.assert_close(best, want_best, equal_nan=True)
    torch.testing.assert_close(norm, torch.logsumexp(logits, dim=-1), equal_nan=True)
    wide = torch.ops.canteen.greedy_pick(logits.bfloat16(), True)
    assert wide[1].tolist() == [0, 3, 35]
    with pytest.raises(RuntimeError, match="float32 or bfloat16 logits"):
        torch.ops.canteen.greedy_pick(logits.half(), True)


def _worker_loads_kernels(folder: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CANTEEN_KERNEL_DIR": str(folder), "CXX": "/bin/false"}
    code = "from worker import kernels; print(kernels.available())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def _plant(folder: Path) -> Path:
    """A copy of this machine's real library where a worker using ``folder`` looks for it."""
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)
    env = {**os.environ, "CANTEEN_KERNEL_DIR": str(folder)}
    code = "from worker import kernels; print(kernels.library_path())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    planted = Path(done.stdout.strip().splitlines()[-1])
    planted.write_bytes(Path(kernels.build()).read_bytes())
    planted.chmod(0o755)
    return planted


def test_a_library_in_a_world_writable_folder_is_refused(tmp_path: Path) -> None:
    planted = _plant(tmp_path / "kernels")
    planted.parent.chmod(0o777)
    done = _worker_loads_kernels(planted.parent)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
    logs = done.stdout + done.stderr
    assert "CPU kernels refused; using the pure-torch path" in logs
    assert (
        f"kernel folder {planted.parent} has mode 0777: it must not be writable by group or "
        "others (at most 0755)"
    ) in logs


def test_a_group_writable_or_symlinked_library_is_refused(tmp_path: Path) -> None:
    planted = _plant(tmp_path / "kernels")
    planted.chmod(0o775)
    done = _worker_loads_kernels(planted.parent)
    logs = done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
    assert f"kernel library {planted} has mode 0775: it must not be writable" in logs

    real = tmp_path / "elsewhere.so"
    planted.rename(real)
    real.chmod(0o755)
    planted.symlink_to(real)
    done = _worker_loads_kernels(planted.parent)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
    assert f"kernel library {planted} must not be a symlink" in done.stdout + done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_library_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    planted = _plant(tmp_path / "kernels")
    os.chown(planted, 12345, 12345)
    done = _worker_loads_kernels(planted.parent)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
    assert (
        f"kernel library {planted} is owned by uid 12345: it must be owned by the worker's "
        "user (uid 0) or root"
    ) in done.stdout + done.stderr


def test_a_checked_library_loads_and_the_build_leaves_no_temporary_file(tmp_path: Path) -> None:
    planted = _plant(tmp_path / "kernels")
    done = _worker_loads_kernels(planted.parent)
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr
    assert sorted(p.name for p in planted.parent.iterdir()) == [".build.lock", planted.name]
