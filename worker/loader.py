"""Loads one model version for paged serving: device, dtype, checksum, model family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from canteen.models import weights_sha256
from worker.attention import ATTENTION_NAME
from worker.fast_linear import use_skinny_linears

# Families whose attention goes through transformers' AttentionInterface with full (not
# sliding-window) causal attention; the paged kernel is exact for them.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite", "olmo2"})


class ModelLoadError(Exception):
    pass


@dataclass
class LoadedModel:
    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device={requested!r}: CUDA is not available on this machine")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        # float32 on CPU: bfloat16 matmuls are far slower on CPUs without AMX.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype: torch.dtype = getattr(torch, requested)
    return dtype


def _eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def load_model(
    path: str,
    fmt: str,
    sha256: str,
    device: torch.device,
    dtype: torch.dtype,
    verify_checksum: bool = True,
) -> LoadedModel:
    weights = Path(path)
    if not weights.exists():
        raise ModelLoadError(f"model path {path!r} does not exist on this worker")
    if verify_checksum and sha256:
        actual = weights_sha256(weights)
        if actual != sha256:
            raise ModelLoadError(
                f"checksum mismatch for {path}: registry has {sha256}, file has {actual}"
            )
    kwargs: dict[str, object] = {"dtype": dtype, "attn_implementation": ATTENTION_NAME}
    if fmt == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(weights.parent), gguf_file=weights.name, **kwargs
        )
    elif fmt == "safetensors":
        model = AutoModelForCausalLM.from_pretrained(str(weights), **kwargs)
    else:
        raise ModelLoadError(f"format={fmt!r}: expected gguf or safetensors")
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model_type={config.model_type!r} is not supported by the paged kernel "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ModelLoadError("sliding-window attention is not supported by the paged kernel")
    model = model.to(device).eval()  # type: ignore[arg-type]
    if device.type == "cpu":
        use_skinny_linears(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return LoadedModel(
        model=model,
        device=device,
        dtype=dtype,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        max_model_len=int(config.max_position_embeddings),
        eos_token_ids=_eos_ids(model),
    )
