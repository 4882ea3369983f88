"""The adapters a step applies, stacked so one step applies all of them at once.

Up to --max-loras adapters sit in slots. Per layer and fused linear the slots' weights are
stacked side by side once, when the slots change (not per step):

    A_all [sum of widths, in]     = [A_slot0; A_slot1; ...]
    B_all [out, sum of widths]    = [B_slot0 | B_slot1 | ...]

and a step computes, for every row at once (no per-row or per-adapter Python loop):

    y = base(x)                                (the base linear, once for all rows)
    y = y + B_all((x @ A_all^T) * mask)        mask[row] = the row's scale over its adapter's
                                               columns, 0 elsewhere (base rows: all 0)

Both matmuls are Canteen's skinny_linear where the base uses it (CPU, bfloat16 or float32):
each output's sum runs along K in one fixed order whatever the rows beside it, so a row's
bits do not depend on the step's other rows. In B_all the other slots' columns meet zeros in
the mask, adding exact zeros; each adapter's columns start on a multiple of SLOT_ALIGN, so
its own products meet the kernel's pairs and blocks alike wherever it sits: an adapter's rows
give the same bits alone, beside other adapters, or beside base rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.lora.adapter import FUSED, LoraWeights
from worker.model.quant import LanesLinear, Linear, make_linear


class _Stacked:
    """One fused linear's stacked A and B for the current slots."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a: Linear = make_linear(a, None, "none")
        self.b: Linear = make_linear(b, None, "none")

    def __call__(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        z = self.a(x) * mask
        if isinstance(self.b, LanesLinear):  # y + B(z) in the kernel, the bits of the two ops
            out: torch.Tensor = torch.ops.canteen.skinny_linear(
                z, self.b.lanes, self.b.out_features, None, y
            )
            return out
        return y + self.b(z)


@dataclass(frozen=True)
class StepLora:
    """A step's adapters: the stacked linears of every layer and one mask per fused linear."""

    stacked: list[dict[str, _Stacked]]
    masks: dict[str, torch.Tensor]  # kind -> [tokens, width]

    def apply(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base linear of ``x``) plus each row's adapter delta."""
        stacked = self.stacked[layer].get(kind)
        return y if stacked is None else stacked(x, y, self.masks[kind])


class LoraSlots:
    """Up to ``max_loras`` adapters, in fixed positions, least recently used replaced."""

    def __init__(self, max_loras: int, num_layers: int) -> None:
        self.max_loras, self.num_layers = max_loras, num_layers
        self._slots: list[LoraWeights] = []  # position order (the stacking order)
        self._used: dict[str, int] = {}  # adapter id -> the last step that applied it
        self._clock = 0
        self._stacked: list[dict[str, _Stacked]] = []
        self._offsets: dict[str, dict[str, int]] = {}  # kind -> adapter id -> first column
        self.num_evictions = 0

    def ids(self) -> list[str]:
        return [w.adapter_id for w in self._slots]

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked copies the forward reads."""
        linears = [lin for per in self._stacked for st in per.values() for lin in (st.a, st.b)]
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
        placed = {w.adapter_id: i for i, w in enumerate(self._slots)}
        evicted: list[str] = []
        for weights in needed:
            # an id names one version (its files checked against one digest): a placed id stays
            if weights.adapter_id not in placed:
                if len(self._slots) < self.max_loras:
                    self._slots.append(weights)
                else:
                    i = min(
                        (j for j, w in enumerate(self._slots) if w.adapter_id not in wanted),
                        key=lambda j: self._used.get(self._slots[j].adapter_id, 0),
                    )
                    evicted.append(self._slots[i].adapter_id)
                    self._used.pop(self._slots[i].adapter_id, None)
                    self._slots[i] = weights
                self._stacked = []  # stale: restacked below
            self._used[weights.adapter_id] = self._clock
        self.num_evictions += len(evicted)
        if not self._stacked and self._slots:
            self._restack()
        return evicted

    def _restack(self) -> None:
        self._offsets = {}
        for kind in FUSED:
            offset, columns = 0, {}
            for w in self._slots:
                if kind in w.width:
                    columns[w.adapter_id] = offset
                    offset += w.width[kind]
            if columns:
                self._offsets[kind] = columns
        stacked: list[dict[str, _Stacked]] = []
        for layer in range(self.num_layers):
            per: dict[str, _Stacked] = {}
            for kind in self._offsets:
                holders = [w for w in self._slots if kind in w.width]
                a = torch.cat([w.a[layer][kind] for w in holders])
                b = torch.cat([w.b[layer][kind] for w in holders], dim=1)
                per[kind] = _Stacked(a, b)
            stacked.append(per)
        self._stacked = stacked

    def step(self, rows: dict[str, torch.Tensor], num_tokens: int, dtype: torch.dtype) -> StepLora:
        """The step's masks for ``rows`` (adapter id -> its flat token indices)."""
        scales = {w.adapter_id: w.scale for w in self._slots}
        masks: dict[str, torch.Tensor] = {}
        device = next(iter(rows.values())).device
        for kind, columns in self._offsets.items():
            width = sum(w.width.get(kind, 0) for w in self._slots)
            mask = torch.zeros(num_tokens, width, dtype=dtype, device=device)
            for adapter_id, index in rows.items():
                if adapter_id in columns:
                    lo = columns[adapter_id]
                    hi = lo + next(w for w in self._slots if w.adapter_id == adapter_id).width[kind]
                    mask[index, lo:hi] = scales[adapter_id]
            masks[kind] = mask
        return StepLora(self._stacked, masks)
