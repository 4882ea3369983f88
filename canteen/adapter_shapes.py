"""Whether a PEFT LoRA adapter fits a base model, read from the files alone (torch-free).

The registry refuses an adapter made for another base at registration rather than letting a
worker fail on it later: every ``lora_A`` / ``lora_B`` tensor's shape must match the base's
projection it adapts, and its layer must exist in the base. The tensor shapes come from the
safetensors header (a length-prefixed JSON object); the base's sizes from its config.json or
its GGUF metadata.

    lora_A of a projection: [r, in_features]      lora_B: [out_features, r]
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

# The longest safetensors header read: far above any adapter's (a few KB per tensor).
MAX_HEADER_BYTES = 64 << 20
_TENSOR = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class BaseDims:
    """The sizes of a Llama-family base that its adapters' tensors must match."""

    hidden: int
    intermediate: int
    num_layers: int
    q_out: int  # num_attention_heads * head_dim
    kv_out: int  # num_key_value_heads * head_dim

    def projection(self, module: str) -> tuple[int, int] | None:
        """(in_features, out_features) of a projection; None for one the base lacks."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_out),
            "k_proj": (h, self.kv_out),
            "v_proj": (h, self.kv_out),
            "o_proj": (self.q_out, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }.get(module)


def read_tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header."""
    with path.open("rb") as stream:
        head = stream.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name}: not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: header of {size} bytes (limit {MAX_HEADER_BYTES})")
        try:
            header = json.loads(stream.read(size))
        except ValueError as exc:
            raise ValueError(f"{path.name}: not a safetensors file ({exc})") from None
    return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def base_dims(path: Path) -> BaseDims:
    """The sizes of the base model at ``path`` (a transformers folder or a GGUF file)."""
    if path.is_dir():
        c = json.loads((path / "config.json").read_text())
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        kv = int(c.get("num_key_value_heads") or heads)
        return BaseDims(
            int(c["hidden_size"]),
            int(c["intermediate_size"]),
            int(c["num_hidden_layers"]),
            heads * head_dim,
            kv * head_dim,
        )
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch_field = reader.get_field("general.architecture")
    arch = "" if arch_field is None else str(arch_field.contents())

    def value(key: str, default: int | None = None) -> int:
        field = reader.get_field(f"{arch}.{key}")
        if field is None:
            if default is None:
                raise ValueError(f"{path.name}: no {arch}.{key} in the GGUF metadata")
            return default
        return int(field.contents())

    hidden, heads = value("embedding_length"), value("attention.head_count")
    head_dim = value("attention.key_length", hidden // heads)
    return BaseDims(
        hidden,
        value("feed_forward_length"),
        value("block_count"),
        heads * head_dim,
        value("attention.head_count_kv", heads) * head_dim,
    )


def check_adapter_fits(adapter: Path, base: Path, base_ref: str) -> None:
    """ValueError naming the first tensor of the adapter folder that does not fit the base
    model at ``base`` (``base_ref`` names it), or the config field that is wrong."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    peft_type = str(config.get("peft_type", ""))
    if peft_type.upper() != "LORA":
        raise ValueError(f"adapter_config.json peft_type={peft_type!r}: only LORA is served")
    dims = base_dims(base)
    shapes = read_tensor_shapes(adapter / "adapter_model.safetensors")
    if not shapes:
        raise ValueError("adapter_model.safetensors holds no tensors")
    for name, shape in sorted(shapes.items()):
        _check_tensor(name, shape, dims, base_ref)


def _check_tensor(name: str, shape: list[int], dims: BaseDims, base_ref: str) -> None:
    match = _TENSOR.search(name)
    if match is None:
        raise ValueError(
            f"adapter tensor {name!r}: not a LoRA weight of a layer's attention or MLP "
            "projection (q/k/v/o_proj, gate/up/down_proj), the modules this server adapts"
        )
    layer, module, side = int(match[1]), match[2], match[3]
    if layer >= dims.num_layers:
        raise ValueError(
            f"adapter tensor {name!r}: layer {layer}, but base {base_ref} has "
            f"{dims.num_layers} layers; the adapter was made for another base"
        )
    features = dims.projection(module)
    if features is None:
        raise ValueError(f"adapter tensor {name!r}: base {base_ref} has no {module}")
    if len(shape) != 2:
        raise ValueError(f"adapter tensor {name!r}: shape {shape}, expected two dimensions")
    # lora_A reads the projection's input; lora_B writes its output
    size, axis = (features[0], 1) if side == "A" else (features[1], 0)
    if shape[axis] != size:
        raise ValueError(
            f"adapter tensor {name!r}: shape {shape}, but {module} of base {base_ref} has "
            f"{'in' if side == 'A' else 'out'}_features {size}; the adapter was made for "
            "another base"
        )
