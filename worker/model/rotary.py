"""Rotary cos and signed sin per position, computed once at load instead of every step.

transformers' rotary module computes, for a step's positions, ``cos(position * inv_freq)``
and ``sin(...)`` (times its attention scaling, cast to the model's dtype); Canteen's forward
then negates the first half of sin once (worker/model/forward.py, ``_rotate``). Each value
depends on its position alone, so the tables below hold those values for every position the
model serves, computed by the module itself, a few positions per call (each call small
enough to run on one thread, as a decode step's does), and a step indexes them: one
``index_select`` per table where the module took about ten ops. The values are the module's
bit for bit (tests/unit/test_rotary_tables.py, against the module called per step).

Rope types whose frequencies change with the step's longest position (``dynamic``,
``longrope``: transformers updates the module's buffers per call) get no tables; the forward
calls the module every step for them, as before.
"""

from __future__ import annotations

import torch
from torch import nn

# Positions per call of the module while filling the tables: 128 x head_dim values stay
# under torch's parallel grain (32,768 elements), so every value is computed on one thread,
# in whole vectors, as in a decode step's call.
_CHUNK = 128


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: rotate_half(x) * sin == swap_halves(x) *
    signed_sin (the same products, bit for bit)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def module_rotary(
    module: nn.Module, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's cos and signed sin for ``positions`` [T]: ([T, 1, D], [T, 1, D])."""
    x = torch.empty(0, dtype=dtype, device=positions.device)  # read for dtype and device only
    cos, sin = module(x, positions.unsqueeze(0))
    return cos[0].unsqueeze(1), signed_sin(sin[0].unsqueeze(1))


def has_static_frequencies(module: nn.Module) -> bool:
    """Whether the module's frequencies stay the same at every call (transformers updates
    them per call for dynamic and longrope types)."""
    rope_type = getattr(module, "rope_type", None)
    return isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"


class RotaryTables:
    """cos and signed sin [positions, 1, D] in the model's dtype, on the module's device."""

    def __init__(
        self, module: nn.Module, num_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        cos: list[torch.Tensor] = []
        sin: list[torch.Tensor] = []
        with torch.no_grad():
            for start in range(0, num_positions, _CHUNK):
                end = min(start + _CHUNK, num_positions)
                c, s = module_rotary(module, torch.arange(start, end, device=device), dtype)
                cos.append(c)
                sin.append(s)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    @property
    def num_positions(self) -> int:
        return int(self.cos.shape[0])

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``positions`` [T] (each below num_positions)."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def rotary_tables(
    module: nn.Module, num_positions: int, dtype: torch.dtype, device: torch.device
) -> RotaryTables | None:
    """Tables for every position below ``num_positions``, or None where the module's
    frequencies change from call to call."""
    if not has_static_frequencies(module) or num_positions <= 0:
        return None
    return RotaryTables(module, num_positions, dtype, device)
