"""The exact 4-bit values of a GGUF file's Q4_1 tensors, named as transformers names them.

A Q4_1 block holds 32 weights as ``d * q + m``: d and m float16, q 4 bits. One block is 20
bytes, ``d | m | 16 bytes of nibbles``; weight j < 16 is the low nibble of byte j, weight
j + 16 its high nibble. transformers dequantizes these to float32 at load; reading the raw
blocks instead lets ``--quantization int4`` carry the same values without re-quantizing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from worker.model.quant import Q4Groups

BLOCK_BYTES = 20
_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpack(raw: np.ndarray, rows: int) -> Q4Groups:
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(rows, -1, BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [rows, groups, 32]
    return Q4Groups(q.reshape(rows, -1).contiguous(), d, m)


def _unpermute_rows(groups: Q4Groups, num_heads: int) -> Q4Groups:
    """Undoes llama.cpp's rotary row order for q/k, as transformers' GGUF loader does."""

    def fix(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[0] // num_heads // 2
        return t.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(t.shape)

    return Q4Groups(fix(groups.q), fix(groups.d), fix(groups.m))


def read_q4_1(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Q4Groups]:
    """``{"model.layers.3.mlp.up_proj.weight": groups, ...}`` for every Q4_1 linear."""
    out: dict[str, Q4Groups] = {}
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        parts = tensor.name.split(".")  # blk.3.ffn_up.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _NAMES:
            continue
        groups = _unpack(tensor.data, int(tensor.shape[-1]))
        if parts[2] == "attn_q":
            groups = _unpermute_rows(groups, num_heads)
        elif parts[2] == "attn_k":
            groups = _unpermute_rows(groups, num_kv_heads)
        out[f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.weight"] = groups
    return out


def exact_groups(
    path: Path, params: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int
) -> dict[str, Q4Groups]:
    """The Q4_1 tensors whose values reproduce transformers' weights bit for bit (in the
    weights' dtype: a bfloat16 model holds the same float32 values rounded the same way)."""
    exact: dict[str, Q4Groups] = {}
    for name, groups in read_q4_1(path, num_heads, num_kv_heads).items():
        weight = params.get(name)
        if weight is not None and torch.equal(groups.dequantize().to(weight.dtype), weight):
            exact[name] = groups
    return exact
