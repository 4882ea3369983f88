"""The exact low-bit values of a GGUF file's Q4_1 and Q8_0 tensors, named as transformers names
them, and which of the two its linears ship (``--quantization auto``).

A Q4_1 block holds 32 weights as ``d * q + m``: d and m float16, q 4 bits. One block is 20
bytes, ``d | m | 16 bytes of nibbles``; weight j < 16 is the low nibble of byte j, weight
j + 16 its high nibble. A Q8_0 block holds 32 weights as ``d * q``: 34 bytes, ``d | 32 int8``.
transformers dequantizes these to float32 at load; reading the raw blocks instead lets
``--quantization int4`` / ``int8`` carry the same values without re-quantizing.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from worker.model.quant import Groups, Q4Groups, Q8Groups

Q4_1_BYTES, Q8_0_BYTES = 20, 34
_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The head: its own tensor, or the token embedding where the model ties the two.
_HEAD_NAMES = ("output.weight", "token_embd.weight")
_KINDS = {GGMLQuantizationType.Q4_1: "Q4_1", GGMLQuantizationType.Q8_0: "Q8_0"}


def _blocks(raw: np.ndarray, rows: int, size: int) -> torch.Tensor:
    return torch.from_numpy(np.array(raw, dtype=np.uint8)).view(rows, -1, size)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _unpack_q4_1(raw: np.ndarray, rows: int) -> Q4Groups:
    blocks = _blocks(raw, rows, Q4_1_BYTES)
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [rows, groups, 32]
    return Q4Groups(q.reshape(rows, -1).contiguous(), _half(blocks, 0), _half(blocks, 2))


def _unpack_q8_0(raw: np.ndarray, rows: int) -> Q8Groups:
    blocks = _blocks(raw, rows, Q8_0_BYTES)
    q = blocks[..., 2:].contiguous().view(torch.int8)
    return Q8Groups(q.reshape(rows, -1).contiguous(), _half(blocks, 0))


def _unpermute_rows(groups: Groups, num_heads: int) -> Groups:
    """Undoes llama.cpp's rotary row order for q/k, as transformers' GGUF loader does."""

    def fix(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[0] // num_heads // 2
        return t.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(t.shape)

    if isinstance(groups, Q4Groups):
        return Q4Groups(fix(groups.q), fix(groups.d), fix(groups.m))
    return Q8Groups(fix(groups.q), fix(groups.d))


def _transformers_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")  # blk.3.ffn_up.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.weight"
    return None


def linear_formats(path: Path) -> Counter[str]:
    """How many of the file's decoder-layer linears ship in each GGML type (``{"Q4_1": 210}``)."""
    return Counter(
        t.tensor_type.name
        for t in GGUFReader(str(path)).tensors
        if _transformers_name(t.name) is not None
    )


def read_groups(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Groups]:
    """``{"model.layers.3.mlp.up_proj.weight": groups, ..., "lm_head.weight": groups}`` for
    every Q4_1 or Q8_0 linear and head."""
    out: dict[str, Groups] = {}
    tensors = [t for t in GGUFReader(str(path)).tensors if t.tensor_type in _KINDS]
    names = {t.name for t in tensors}
    head = next((n for n in _HEAD_NAMES if n in names), None)
    for tensor in tensors:
        name = "lm_head.weight" if tensor.name == head else _transformers_name(tensor.name)
        if name is None:
            continue
        rows = int(tensor.shape[-1])
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            groups: Groups = _unpack_q4_1(tensor.data, rows)
        else:
            groups = _unpack_q8_0(tensor.data, rows)
        if ".attn_q." in tensor.name:
            groups = _unpermute_rows(groups, num_heads)
        elif ".attn_k." in tensor.name:
            groups = _unpermute_rows(groups, num_kv_heads)
        out[name] = groups
    return out


def exact_groups(
    path: Path, params: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int
) -> dict[str, Groups]:
    """The tensors whose values reproduce transformers' weights bit for bit (in the weights'
    dtype: a bfloat16 model holds the same float32 values rounded the same way)."""
    exact: dict[str, Groups] = {}
    for name, groups in read_groups(path, num_heads, num_kv_heads).items():
        weight = params.get(name)
        if weight is not None and torch.equal(groups.dequantize().to(weight.dtype), weight):
            exact[name] = groups
    return exact
