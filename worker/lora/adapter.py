"""One PEFT LoRA adapter, read from its folder and checked against the base model.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with, per
targeted projection, ``A`` [r, in] and ``B`` [out, r]; the projection computes
``base(x) + B(A(x)) * scale``, scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

Canteen's forward fuses q/k/v and gate/up (worker/model/forward.py), so the adapter is
rearranged here once, at load, per layer and fused linear ("kind"):

    A    [parts x r, in]   the parts' A stacked: q rows 0..r-1, k rows r..2r-1, v rows 2r..3r-1
    B_i  [out_i, r]        each part's own B, applied to its r columns of A's output

(zeros in A, and no B, for a part the adapter does not target). Where Canteen's kernels run
(CPU, bfloat16 or float32) both are stored in skinny_linear's lanes layout (pack_lanes) that
canteen::lora_add reads (worker/kernels/lora.cpp), and only that copy is kept.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from canteen.adapters import AdapterRef
from canteen.models import adapter_files_sha256, read_adapter_files
from worker.model.quant import pack_lanes, uses_lanes

# fused linear -> the projections it computes side by side, in its output order
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_KIND_OF = {part: kind for kind, parts in FUSED.items() for part in parts}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoraError(Exception):
    """Why an adapter cannot be served (a request's error: the adapter, not the worker)."""


@dataclass(frozen=True)
class BaseShape:
    """What an adapter must fit: the base's layers and each fused linear's sizes."""

    num_layers: int
    in_features: dict[str, int]  # kind -> input features
    part_sizes: dict[str, tuple[int, ...]]  # kind -> output features of each part

    @staticmethod
    def of(config: Any) -> BaseShape:
        """From a transformers llama-family config."""
        hidden, inner = config.hidden_size, config.intermediate_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return BaseShape(
            num_layers=config.num_hidden_layers,
            in_features={"qkv": hidden, "o": q, "gate_up": hidden, "down": inner},
            part_sizes={
                "qkv": (q, kv, kv),
                "o": (hidden,),
                "gate_up": (inner, inner),
                "down": (hidden,),
            },
        )


@dataclass(frozen=True)
class KindWeights:
    """An adapter's weights for one fused linear: A stacked over the parts, each part's B."""

    a: torch.Tensor  # [parts x r, in], or its lanes layout
    b: tuple[torch.Tensor | None, ...]  # per part: [out_i, r] or its lanes layout; None: untargeted


@dataclass(frozen=True)
class LoraWeights:
    """An adapter as the forward applies it, in the model's dtype and device."""

    adapter_id: str
    rank: int
    scale: float
    is_lanes: bool  # weights in pack_lanes' layout (canteen::lora_add), else plain
    layers: list[dict[str, KindWeights]]  # per layer, kind -> its weights (targeted kinds only)

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes
            for layer in self.layers
            for w in layer.values()
            for t in (w.a, *w.b)
            if t is not None
        )


def _scale(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scale) from adapter_config.json; LoraError naming the field it cannot serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type={config.get('peft_type')!r}: only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise LoraError(f"r={rank!r}: the rank must be in 1..{max_rank} (--max-lora-rank)")
    for name in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(name):
            raise LoraError(f"{name} is set: per-module ranks and saved modules are not served")
    if config.get("use_dora"):
        raise LoraError("use_dora=true: DoRA adapters are not served")
    if config.get("bias", "none") != "none":
        raise LoraError(f"bias={config.get('bias')!r}: only bias='none' adapters are served")
    alpha = float(config.get("lora_alpha", 8))
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_adapter(ref: AdapterRef, verify: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and tensors of ``ref``'s folder, after checking the bytes read against the
    digest the registry recorded (the same bytes are parsed: nothing is read twice)."""
    try:
        files = read_adapter_files(Path(ref.path))
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        raise LoraError(str(exc)) from exc
    if verify and ref.sha256:
        actual = adapter_files_sha256(files)
        if actual != ref.sha256:
            raise LoraError(
                f"checksum mismatch for {ref.path}: registry has {ref.sha256}, files have "
                f"{actual} (the sha256 covers adapter_config.json and adapter_model.safetensors)"
            )
    try:
        config = json.loads(files["adapter_config.json"])
        tensors = load_safetensors(files["adapter_model.safetensors"])
    except (ValueError, RuntimeError) as exc:
        raise LoraError(f"unreadable adapter files in {ref.path}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError("adapter_config.json must hold a JSON object")
    return config, tensors


def _sorted_tensors(
    tensors: dict[str, torch.Tensor], shape: BaseShape, rank: int
) -> dict[tuple[int, str, str], torch.Tensor]:
    """(layer, part, "A" or "B") -> tensor, each checked against the base's shapes."""
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in _KIND_OF:
            raise LoraError(
                f"tensor {key}: only q, k, v, o, gate, up and down projections are served"
            )
        layer, part, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shape.num_layers:
            raise LoraError(f"tensor {key}: layer {layer}, the base has {shape.num_layers}")
        kind = _KIND_OF[part]
        out = shape.part_sizes[kind][FUSED[kind].index(part)]
        want = (rank, shape.in_features[kind]) if which == "A" else (out, rank)
        if tuple(tensor.shape) != want:
            raise LoraError(
                f"tensor {key}: shape {list(tensor.shape)}, the base needs {list(want)}"
            )
        found[(layer, part, which)] = tensor
    for layer, part, which in found:
        if (layer, part, "B" if which == "A" else "A") not in found:
            raise LoraError(f"layer {layer} {part}: lora_A and lora_B must come together")
    if not found:
        raise LoraError("adapter_model.safetensors holds no LoRA tensors")
    return found


def load_adapter(
    ref: AdapterRef,
    shape: BaseShape,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
    verify: bool = True,
) -> LoraWeights:
    """``ref`` read, checked and laid out for the fused linears; LoraError says why not."""
    config, tensors = read_adapter(ref, verify)
    rank, scale = _scale(config, max_rank)
    found = _sorted_tensors(tensors, shape, rank)
    kinds = sorted({_KIND_OF[part] for _, part, _ in found})
    probe = torch.empty(0, dtype=dtype, device=device)
    lanes = uses_lanes(probe)
    layers: list[dict[str, KindWeights]] = []
    for layer in range(shape.num_layers):
        per_kind: dict[str, KindWeights] = {}
        for kind in kinds:
            parts = FUSED[kind]
            a = torch.zeros(len(parts) * rank, shape.in_features[kind], dtype=torch.float32)
            b: list[torch.Tensor | None] = []
            for i, part in enumerate(parts):
                if (layer, part, "A") not in found:
                    b.append(None)
                    continue
                a[i * rank : (i + 1) * rank] = found[(layer, part, "A")]
                b.append(_laid_out(found[(layer, part, "B")], dtype, device, lanes))
            if any(t is not None for t in b):
                per_kind[kind] = KindWeights(_laid_out(a, dtype, device, lanes), tuple(b))
        layers.append(per_kind)
    return LoraWeights(ref.id, rank, scale, lanes, layers)


def _laid_out(
    weight: torch.Tensor, dtype: torch.dtype, device: torch.device, lanes: bool
) -> torch.Tensor:
    """``weight`` in the model's dtype, in the lanes layout where the kernels take it."""
    w = weight.to(device, dtype)
    return pack_lanes(w) if lanes else w.contiguous()
