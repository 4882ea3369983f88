"""Linear layers prepared once at load for the device's matmul kernel.

    none  dense weights in the model's dtype: on CPU with Canteen's kernels (bfloat16 and
          float32), every step through Canteen's skinny_linear, from the weights in its own
          layout (LanesLinear); on a CPU without them, prepacked for oneDNN with rows padded
          to a bounded set of buckets (PackedLinear); on CUDA, and float16, ``F.linear``.
    int8  one int8 per weight, one scale per output row: ``torch._weight_int8pack_mm``.
    int4  4-bit weights in groups of 32 along the input, each group with a scale and a zero
          point: ``aten._weight_int4pack_mm_for_cpu``. Its dequantized weight is
          ``(q - 8) * scale + zero``, so a GGUF Q4_1 block (``d * q + m``) fits exactly as
          ``scale = d, zero = m + 8 d`` (see worker/model/gguf_q4.py).

Where Canteen's ``quant_linear`` runs vectorized (AVX512-BF16, or AVX2), every step takes it
(worker/kernels/lowbit.cpp): the file's own 4- or 8-bit values with float16 d and m, times the
bfloat16 activations as they are, float32 sums in one order for every row count. torch's
kernels above are the fallback only where Canteen's kernels are not built.

Both low-bit kernels are fast only with bfloat16 activations on this CPU (float32 and float16
activations ran 10-50x slower), so quantized layers compute in bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker import kernels

QUANTIZATIONS = ("none", "int8", "int4")
GROUP_SIZE = 32

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Q4Groups:
    """Unsigned 4-bit weights with an affine map per group of 32: ``w = d * q + m``."""

    q: torch.Tensor  # [out, in] uint8 in 0..15
    d: torch.Tensor  # [out, in // 32] float32
    m: torch.Tensor  # [out, in // 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP_SIZE, GROUP_SIZE).float() * self.d.unsqueeze(-1)
        return (w + self.m.unsqueeze(-1)).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Groups]) -> Q4Groups:
        return Q4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


@dataclass(frozen=True)
class Q8Groups:
    """int8 weights with a scale per group of 32 (a GGUF Q8_0 block): ``w = d * q``."""

    q: torch.Tensor  # [out, in] int8
    d: torch.Tensor  # [out, in // 32] float32

    @staticmethod
    def cat(parts: list[Q8Groups]) -> Q8Groups:
        return Q8Groups(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return (self.q.view(n, k // GROUP_SIZE, GROUP_SIZE).float() * self.d.unsqueeze(-1)).view(
            n, k
        )


Groups = Q4Groups | Q8Groups


def cat_groups(parts: list[Groups]) -> Groups | None:
    """Linears fused side by side (q/k/v, gate/up): their groups stacked, where all are of
    one kind; None otherwise (the fused layer then quantizes the stacked weight)."""
    q4 = [p for p in parts if isinstance(p, Q4Groups)]
    q8 = [p for p in parts if isinstance(p, Q8Groups)]
    if parts and len(q4) == len(parts):
        return Q4Groups.cat(q4)
    if parts and len(q8) == len(parts):
        return Q8Groups.cat(q8)
    return None


def q4_from_float(weight: torch.Tensor) -> Q4Groups:
    """Asymmetric round-to-nearest per group of 32 (what Q4_1 does)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).clamp_min(1e-12)
    q = ((groups - low.unsqueeze(-1)) / d.unsqueeze(-1)).round().clamp(0, 15)
    return Q4Groups(q.to(torch.uint8).view(n, k), d, low)


# Row counts oneDNN ever sees: a oneDNN matmul builds (JIT-compiles) a kernel per input
# shape, ~5 ms and ~0.6 MiB each, kept in a cache of 1,024. Unbounded shapes grew the worker's
# RSS past its budget under load and stalled steps whenever a new batch size appeared; padding
# rows up to a bucket bounds the set, and ``warm_up`` builds all of them before the memory
# budget is measured. Up to 64 rows a step reads weights (padding is nearly free); above, the
# buckets are 1.5x apart and longer inputs go through in 256-row pieces.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


# bfloat16 and float32 on the CPU (Canteen's kernels loaded): every step, whatever its row
# count, goes through Canteen's own kernel (worker/kernels/dense.cpp, dense_float.cpp): each
# output's sum runs along K in one fixed order that does not depend on the rows beside it, so
# a sequence's logits are the same bits alone, in a batch of any width, in a prefill chunk or
# while verifying drafts (README, Exactness). oneDNN's GEMM blocks K by the row count, so its
# bits change with the batch; it is kept only where Canteen's kernels are not (no compiler,
# CANTEEN_KERNELS=0). Measured: docs/kernels.md and `python bench/linears.py`.
SKINNY_DTYPES = (torch.bfloat16, torch.float32)


def row_bucket(rows: int) -> int:
    """The smallest bucket holding ``rows`` (at most ROW_BUCKETS[-1])."""
    return next(b for b in ROW_BUCKETS if b >= rows)


LANES = 16  # output rows per block of skinny_linear's and quant_linear's layouts


def pack_lanes(weight: torch.Tensor) -> torch.Tensor:
    """skinny_linear's layout (worker/kernels/dense.cpp, dense_float.cpp): [N, K] ->
    [ceil(N / 16), ceil(K / p), 16, p], output rows in blocks of 16 lanes, each lane p
    adjacent weights of its row (a pair of bfloat16, one float32); zeros past N and K."""
    n, k = weight.shape
    per = 1 if weight.dtype == torch.float32 else 2
    padded = F.pad(weight, (0, -k % per, 0, -n % LANES))
    return padded.view(-1, LANES, -(-k // per), per).transpose(1, 2).contiguous()


class LanesLinear:
    """A CPU linear in bfloat16 or float32 through Canteen's kernel for every row count, from
    its own layout of the weights (pack_lanes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.lanes = pack_lanes(weight.contiguous())
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.canteen.skinny_linear(
            x, self.lanes, self.out_features, self.bias
        )
        return out


class DenseLinear:
    """``F.linear`` on the weight as loaded: CUDA, float16, and CPUs without Canteen's kernels
    where oneDNN cannot prepack the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """bfloat16 or float32 on a CPU without Canteen's kernels: the weight reordered once into
    oneDNN's blocked layout, rows padded to ROW_BUCKETS. A row's bits depend on the step's
    row count here (oneDNN blocks K by shape): exactness across batches needs the kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.in_features, self.dtype = weight.shape[1], weight.dtype
        # An opaque oneDNN tensor: only _linear_pointwise may read it (new_zeros on it
        # corrupts the heap).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, most = x.shape[0], ROW_BUCKETS[-1]
        if rows > most:
            return torch.cat([self(x[lo : lo + most]) for lo in range(0, rows, most)])
        bucket = row_bucket(rows)
        if bucket != rows:
            x = F.pad(x, (0, 0, 0, bucket - rows))
        packed: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "none", [], ""
        )
        return packed if bucket == rows else packed[:rows]

    def warm_up(self) -> None:
        """Builds oneDNN's kernel for every bucket now (load time), not under load."""
        for rows in ROW_BUCKETS:
            self(torch.zeros(rows, self.in_features, dtype=self.dtype))


def uses_lanes(weight: torch.Tensor) -> bool:
    """Whether Canteen's kernel computes this weight's linear (CPU, bfloat16 or float32)."""
    return weight.device.type == "cpu" and weight.dtype in SKINNY_DTYPES and kernels.available()


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
    )


# An int8 or int4 layer sends every row of a step through Canteen's quant_linear: the weights
# widened to bfloat16 exactly, bfloat16 dot products with the activations as they are, each
# row's sums its own, group by group along K, so a row's bits do not depend on the batch.
# Measured: docs/kernels.md (the quant_linear row).


@dataclass(frozen=True)
class GroupPacked:
    """quant_linear's layout (worker/kernels/lowbit.cpp): output rows in blocks of 16, one
    32-bit lane per row holding a pair of adjacent weights; per block and group 16 pairs of 16
    lanes, at 8 bits one int8 per weight (32 bytes a pair), at 4 bits pair s in the low
    nibbles and pair s + 8 in the high ones (32 bytes for two pairs); float16 (d, m) per
    lane and group, the weight being ``d * q + m``."""

    weights: torch.Tensor  # [ceil(out / 16), in // 32, 256 or 512] uint8
    scales: torch.Tensor  # [ceil(out / 16), in // 32, 2, 16] float16: d, then m
    out_features: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = torch.ops.canteen.quant_linear(
            x, self.weights, self.scales, self.out_features, bias
        )
        return out


def pack_groups(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> GroupPacked:
    """``q`` [out, in]: 0..15 (4 bits, uint8) or -128..127 (8 bits, int8); ``d`` and ``m``
    [out, in // 32], exact in float16 (a GGUF block's own)."""
    n, k = q.shape
    groups, blocks = k // GROUP_SIZE, -(-n // LANES)
    pad = (0, 0, 0, blocks * LANES - n)  # zero rows up to a whole block
    raw = q.to(torch.int8).view(torch.uint8) if bits == 8 else q.to(torch.uint8)
    # [block, lane, group, pair, weight] -> [block, group, pair, lane, weight]
    pairs = F.pad(raw, pad).view(blocks, LANES, groups, GROUP_SIZE // 2, 2).permute(0, 2, 3, 1, 4)
    if bits == 4:  # pair s in the low nibbles, pair s + 8 in the high ones
        pairs = pairs[:, :, :8] | (pairs[:, :, 8:] << 4)
    weights = pairs.reshape(blocks, groups, -1).contiguous()
    per_lane = [F.pad(t, pad).view(blocks, LANES, groups).transpose(1, 2) for t in (d, m)]
    scales = torch.stack(per_lane, dim=2).to(torch.float16).contiguous()
    return GroupPacked(weights, scales, n)


def _fast_path(k: int, pack: Callable[[], GroupPacked]) -> GroupPacked | None:
    """A second copy of the weights for quant_linear (+1x the low-bit weights in RAM), where it
    runs vectorized and the input splits into whole groups."""
    return pack() if k % GROUP_SIZE == 0 and kernels.quant_vectorized() else None


class _LowBitLinear:
    """quant_linear's copy where it runs (every step), else torch's kernel (``fallback``)."""

    packed: GroupPacked | None
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        return self.fallback(x)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(_LowBitLinear):
    """int8 weights: a GGUF's Q8_0 blocks as they are (``q8``: int8 and a float16 scale per
    group of 32) where the file has them, else one scale per output row. torch's fallback
    kernel takes only row scales, so it re-quantizes ``weight`` per row."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, q8: Q8Groups | None = None
    ) -> None:
        w = weight.float()
        self.scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.weight = (w / self.scales.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        self.scales = self.scales.to(torch.bfloat16)
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.q8 = q8
        self.packed = _fast_path(weight.shape[1], self._groups)

    def _groups(self) -> GroupPacked:
        if self.q8 is not None:
            q, d = self.q8.q, self.q8.d
        else:  # the row's scale for each of its groups
            q, d = (
                self.weight,
                self.scales.float().unsqueeze(1).expand(-1, self.weight.shape[1] // GROUP_SIZE),
            )
        return pack_groups(q, d, torch.zeros_like(d), bits=8)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        """torch's int8 kernel (bfloat16 activations), for CPUs quant_linear is slow on."""
        out = torch._weight_int8pack_mm(x, self.weight, self.scales)
        return out if self.bias is None else out + self.bias


class Int4Linear(_LowBitLinear):
    """``dtype`` is the activations': torch's kernel wants its scales and zeros in it. Only
    float32 holds Q4_1's float16 d and m exactly; bfloat16 (the fast one) rounds them."""

    def __init__(
        self, groups: Q4Groups, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.int(), 1)
        zeros = groups.m + 8 * groups.d
        # [in // 32, out, 2]: the kernel's layout of (scale, zero) per group.
        self.scales_and_zeros = (
            torch.stack([groups.d, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
        )
        self.bias = None if bias is None else bias.to(dtype)
        self.packed = _fast_path(
            groups.q.shape[1], lambda: pack_groups(groups.q, groups.d, groups.m, bits=4)
        )

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        """torch's int4 kernel (activations in ``dtype``), for CPUs quant_linear is slow on."""
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.weight, GROUP_SIZE, self.scales_and_zeros
        )
        return out if self.bias is None else out + self.bias


def kernel_form(linear: Linear) -> tuple[list[torch.Tensor], int] | None:
    """``linear`` as canteen::decode_layers takes it (worker/kernels/stack.cpp): its (a, b,
    bias) tensors and its output features; None where no kernel of Canteen's computes it."""
    none = torch.empty(0)
    if isinstance(linear, LanesLinear):
        bias = none if linear.bias is None else linear.bias
        return [linear.lanes, none, bias], linear.out_features
    if isinstance(linear, _LowBitLinear) and linear.packed is not None:
        packed, bias = linear.packed, none if linear.bias is None else linear.bias
        return [packed.weights, packed.scales, bias], packed.out_features
    return None


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantization: str,
    groups: Groups | None = None,
) -> Linear:
    """The layer for ``weight`` [out, in]; ``groups`` carries a file's exact 4- or 8-bit
    values when known (used where they match ``quantization``)."""
    if quantization == "none":
        if uses_lanes(weight):
            return LanesLinear(weight, bias)
        return PackedLinear(weight, bias) if can_pack(weight) else DenseLinear(weight, bias)
    q8 = groups if isinstance(groups, Q8Groups) else None
    if quantization == "int8":
        return Int8Linear(weight, bias, q8)
    if quantization == "int4":
        if weight.shape[1] % GROUP_SIZE:
            return Int8Linear(weight, bias)  # no whole groups: int8 is the next best
        q4 = groups if isinstance(groups, Q4Groups) else q4_from_float(weight)
        return Int4Linear(q4, bias)
    raise ValueError(f"quantization={quantization!r}: expected one of {QUANTIZATIONS}")
