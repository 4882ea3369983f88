"""The adapters a step applies, each to its own rows only.

Up to --max-loras adapters sit in slots (the store's own tensors: nothing is copied). A
step groups its rows by adapter and computes, per linear:

    y = base(x)                                the base linear, once for every row
    for each adapter g of the step:            a handful of adapters, not rows
        z = T(A_g(x[rows_g]) * scale_g)        its rows only, its own columns only
        y[rows_g, part i] += B_gi(z_i)         each part's own B: no block-diagonal zeros

so a row computes its own adapter's products and nothing else, and base rows none. Where
Canteen's kernels run, all of it is one canteen::lora_add per linear (worker/kernels/
lora.cpp): each output's sum runs along K in one fixed order whatever the rows beside it, so
a row's bits depend only on its own input and its adapter: the same alone, beside other
adapters or beside base rows. ``canteen::decode_layers`` (worker/kernels/stack.cpp) makes the
same call per linear (``StepLora.kernel_args``), so the same bits as ``StepLora.apply``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.lora.adapter import FUSED, LoraWeights

KINDS = tuple(FUSED)  # the order decode_layers takes the linears in: qkv, o, gate_up, down


@dataclass(frozen=True)
class _Slotted:
    """What a set of adapters needs per step, built once per set (slot order): per layer and
    kind, every adapter's A and each part's B, empty where it lacks them."""

    adapters: tuple[LoraWeights, ...]
    ranks: list[int]
    weights: list[dict[str, list[torch.Tensor]]]  # per layer, kind -> lora_add's weights
    flat: list[torch.Tensor]  # decode_layers' order: per layer, per kind, the list above

    @staticmethod
    def of(adapters: tuple[LoraWeights, ...], num_layers: int) -> _Slotted:
        none = torch.empty(0)
        weights: list[dict[str, list[torch.Tensor]]] = []
        for layer in range(num_layers):
            per_kind: dict[str, list[torch.Tensor]] = {}
            for kind in KINDS:
                out: list[torch.Tensor] = []
                for w in adapters:
                    got = w.layers[layer].get(kind)
                    if got is None:
                        out += [none] * (1 + len(FUSED[kind]))
                    else:
                        out += [got.a, *(none if b is None else b for b in got.b)]
                per_kind[kind] = out
            weights.append(per_kind)
        flat = [t for per_kind in weights for kind in KINDS for t in per_kind[kind]]
        return _Slotted(adapters, [w.rank for w in adapters], weights, flat)


@dataclass(frozen=True)
class StepLora:
    """A step's adapters: their rows (adapter after adapter), scales and weights."""

    rows: torch.Tensor  # every adapter's flat token indices, adapter after adapter (int64)
    counts: list[int]  # rows per adapter
    scales: torch.Tensor  # per adapter, float64
    parts: dict[str, list[int]]  # kind -> its parts' output features
    slotted: _Slotted

    def apply(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base linear of ``x``) plus each row's adapter delta, in place."""
        weights = self.slotted.weights[layer][kind]
        if all(t.numel() == 0 for t in weights):
            return y
        if all(w.is_lanes for w in self.slotted.adapters):
            torch.ops.canteen.lora_add(
                y,
                x,
                self.rows,
                self.counts,
                self.scales,
                self.slotted.ranks,
                weights,
                self.parts[kind],
            )
            return y
        return self._apply_torch(layer, kind, x, y)

    def _apply_torch(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The same sums as torch ops, where Canteen's kernels do not run (their bits differ)."""
        first, scales = 0, self.scales.tolist()
        for count, scale, w in zip(self.counts, scales, self.slotted.adapters, strict=True):
            rows = self.rows[first : first + count]
            first += count
            got = w.layers[layer].get(kind)
            if got is None:
                continue
            z = (x.index_select(0, rows) @ got.a.T) * torch.tensor(scale, dtype=x.dtype)
            out = y.index_select(0, rows)
            at = 0
            for i, (b, size) in enumerate(zip(got.b, self.parts[kind], strict=True)):
                if b is not None:
                    part = z[:, i * w.rank : (i + 1) * w.rank] @ b.T
                    out[:, at : at + size] = out[:, at : at + size] + part
                at += size
            y.index_copy_(0, rows, out)
        return y

    def kernel_args(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The step as decode_layers takes it, or None where the weights are not laid out
        for the kernels:

        lora   [rows, scales], then per layer, per kind (KINDS), per adapter: A's lanes and
               each part's B lanes (empty tensors where it lacks them)
        sizes  rows per adapter, rank per adapter, then every kind's part sizes
        """
        if not all(w.is_lanes for w in self.slotted.adapters):
            return None
        sizes = [*self.counts, *self.slotted.ranks, *(n for k in KINDS for n in self.parts[k])]
        return [self.rows, self.scales, *self.slotted.flat], sizes


class LoraSlots:
    """Up to ``max_loras`` adapters, in fixed positions, least recently used replaced."""

    def __init__(self, max_loras: int, num_layers: int, parts: dict[str, list[int]]) -> None:
        self.max_loras, self.num_layers, self.parts = max_loras, num_layers, parts
        self._slots: list[LoraWeights] = []  # position order
        self._used: dict[str, int] = {}  # adapter id -> the last step that applied it
        self._clock = 0
        self._cached: _Slotted | None = None  # the last step's set of adapters
        self.num_evictions = 0

    def ids(self) -> list[str]:
        return [w.adapter_id for w in self._slots]

    @property
    def nbytes(self) -> int:
        """Bytes the slotted adapters hold (the store's tensors, shared, not copies)."""
        return sum(w.nbytes for w in self._slots)

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
                if len(self._slots) < self.max_loras:
                    self._slots.append(weights)
                else:
                    ids = self.ids()
                    i = min(
                        (j for j, a in enumerate(ids) if a not in wanted),
                        key=lambda j: self._used.get(ids[j], 0),
                    )
                    evicted.append(self._slots[i].adapter_id)
                    self._used.pop(self._slots[i].adapter_id, None)
                    self._slots[i] = weights
            self._used[weights.adapter_id] = self._clock
        self.num_evictions += len(evicted)
        return evicted

    def step(self, rows: dict[str, list[int]], device: torch.device) -> StepLora:
        """The step's groups for ``rows`` (adapter id -> its flat token indices), in slot order."""
        present = tuple(w for w in self._slots if w.adapter_id in rows)
        cached = self._cached
        if (
            cached is None
            or len(cached.adapters) != len(present)
            or any(a is not b for a, b in zip(cached.adapters, present, strict=True))
        ):
            cached = self._cached = _Slotted.of(present, self.num_layers)
        flat = [i for w in present for i in rows[w.adapter_id]]
        return StepLora(
            torch.tensor(flat, dtype=torch.long, device=device),
            [len(rows[w.adapter_id]) for w in present],
            torch.tensor([w.scale for w in present], dtype=torch.float64),
            self.parts,
            cached,
        )
