"""Linear layers tuned for the skinny shapes of decode on CPU.

MKL's float32 GEMM is slow when the activation has few rows (decode: one row per running
sequence). Computing ``(W @ x.T).T`` instead of ``x @ W.T`` runs those shapes markedly faster
with the same result; for prefill-sized inputs the usual path is faster, so the switch is
by row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_MAX_ROWS = 64


class SkinnyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > SKINNY_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        out = (self.weight @ flat.T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module) -> int:
    """Turns every nn.Linear of ``model`` into a SkinnyLinear in place; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            # Same parameters, same state dict; only forward changes.
            module.__class__ = SkinnyLinear
            count += 1
    return count
