"""The adapters a step applies, each to its own rows only.

Up to --max-loras adapters sit in slots. An adapter's A and B are laid out for the base's
linear kernel once, when it takes a slot (the others' layouts stay as they are). A step
groups its rows by adapter (one index tensor per adapter) and computes, per linear:

    y = base(x)                                the base linear, once for every row
    for each adapter g of the step:            a handful of adapters, not rows
        z = A_g(x[rows_g]) * scale_g           its rows only, its own columns only
        y[rows_g] = y[rows_g] + B_g(z)         skinny_linear with the residual: one op

so a row computes its own adapter's products and nothing else, and base rows none. Both
matmuls are Canteen's skinny_linear where the base uses it (CPU, bfloat16 or float32):
each output's sum runs along K in one fixed order whatever the rows beside it, so a row's
bits depend only on its own input and its adapter: the same alone, beside other adapters
or beside base rows. ``canteen::decode_layers`` (worker/kernels/stack.cpp) runs the same
ops per linear in C++ (``StepLora.kernel_args``), the same bits as ``StepLora.apply``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.lora.adapter import FUSED, LoraWeights
from worker.model.quant import LanesLinear, Linear, make_linear

KINDS = tuple(FUSED)  # the order decode_layers takes the linears in: qkv, o, gate_up, down


@dataclass(frozen=True)
class _Packed:
    """One adapter's linears in the base kernel's layout: per layer, kind -> (A, B)."""

    weights: LoraWeights
    layers: list[dict[str, tuple[Linear, Linear]]]

    @staticmethod
    def of(weights: LoraWeights) -> _Packed:
        layers = [
            {
                kind: (make_linear(a[kind], None, "none"), make_linear(b[kind], None, "none"))
                for kind in a
            }
            for a, b in zip(weights.a, weights.b, strict=True)
        ]
        return _Packed(weights, layers)

    @property
    def is_lanes(self) -> bool:
        """Whether every linear runs on skinny_linear (what decode_layers takes)."""
        return all(
            isinstance(lin, LanesLinear) for per in self.layers for p in per.values() for lin in p
        )


@dataclass(frozen=True)
class StepLora:
    """A step's adapters: per adapter, its rows, its scale and its packed linears."""

    rows: list[torch.Tensor]  # per adapter: its flat token indices
    scales: list[torch.Tensor]  # per adapter: 0-dim, in the activations' dtype
    packed: list[_Packed]

    def apply(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base linear of ``x``) plus each row's adapter delta, in place."""
        for rows, scale, packed in zip(self.rows, self.scales, self.packed, strict=True):
            pair = packed.layers[layer].get(kind)
            if pair is None:
                continue
            a, b = pair
            z = a(x.index_select(0, rows)) * scale
            base = y.index_select(0, rows)
            if isinstance(b, LanesLinear):  # base + B(z) in the kernel: one op, one rounding
                out = torch.ops.canteen.skinny_linear(z, b.lanes, b.out_features, None, base)
            else:
                out = base + b(z)
            y.index_copy_(0, rows, out)
        return y

    def kernel_args(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The step as decode_layers takes it, or None where a linear has no lanes layout:

        lora    [rows_0, scale_0, rows_1, scale_1, ...], then per layer, per kind (KINDS),
                per adapter: A's lanes, B's lanes (two empty tensors where it lacks the kind)
        widths  per kind, per adapter: A's output features (0 where it lacks the kind)
        """
        if not all(p.is_lanes for p in self.packed):
            return None
        none = torch.empty(0)
        lora: list[torch.Tensor] = []
        for rows, scale in zip(self.rows, self.scales, strict=True):
            lora += [rows, scale]
        widths = [p.weights.width.get(kind, 0) for kind in KINDS for p in self.packed]
        for layer in range(len(self.packed[0].layers)):
            for kind in KINDS:
                for p in self.packed:
                    a, b = p.layers[layer].get(kind, (None, None))
                    if isinstance(a, LanesLinear) and isinstance(b, LanesLinear):
                        lora += [a.lanes, b.lanes]
                    else:  # the adapter lacks this linear (is_lanes holds for the rest)
                        lora += [none, none]
        return lora, widths


class LoraSlots:
    """Up to ``max_loras`` adapters, in fixed positions, least recently used replaced."""

    def __init__(self, max_loras: int, num_layers: int) -> None:
        self.max_loras, self.num_layers = max_loras, num_layers
        self._slots: list[_Packed] = []  # position order
        self._used: dict[str, int] = {}  # adapter id -> the last step that applied it
        self._clock = 0
        self.num_evictions = 0

    def ids(self) -> list[str]:
        return [p.weights.adapter_id for p in self._slots]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copies the forward reads."""
        linears = [
            lin for p in self._slots for per in p.layers for pair in per.values() for lin in pair
        ]
        return sum(
            t.nbytes for lin in linears for t in vars(lin).values() if isinstance(t, torch.Tensor)
        )

    def place(self, needed: list[LoraWeights]) -> list[str]:
        """Puts every adapter of ``needed`` (at most max_loras) in a slot, replacing the least
        recently used others; returns the ids replaced."""
        if len(needed) > self.max_loras:
            raise ValueError(f"{len(needed)} adapters in one step; --max-loras is {self.max_loras}")
        self._clock += 1
        wanted = {w.adapter_id for w in needed}
        placed = set(self.ids())
        evicted: list[str] = []
        for weights in needed:
            # an id names one version (its files checked against one digest): a placed id stays
            if weights.adapter_id not in placed:
                packed = _Packed.of(weights)  # only the new adapter is laid out
                if len(self._slots) < self.max_loras:
                    self._slots.append(packed)
                else:
                    ids = self.ids()
                    i = min(
                        (j for j, a in enumerate(ids) if a not in wanted),
                        key=lambda j: self._used.get(ids[j], 0),
                    )
                    evicted.append(self._slots[i].weights.adapter_id)
                    self._used.pop(self._slots[i].weights.adapter_id, None)
                    self._slots[i] = packed
            self._used[weights.adapter_id] = self._clock
        self.num_evictions += len(evicted)
        return evicted

    def step(self, rows: dict[str, torch.Tensor], num_tokens: int, dtype: torch.dtype) -> StepLora:
        """The step's groups for ``rows`` (adapter id -> its flat token indices), in slot order."""
        present = [p for p in self._slots if p.weights.adapter_id in rows]
        return StepLora(
            [rows[p.weights.adapter_id] for p in present],
            [torch.tensor(p.weights.scale, dtype=dtype) for p in present],
            present,
        )
