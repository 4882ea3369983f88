"""Loads one model version for paged serving: device, dtype, checksum, model family, forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from canteen.logging import get_logger
from canteen.models import weights_sha256
from worker.attention.interface import ATTENTION_NAME, PagedBatch
from worker.model.fast_linear import use_skinny_linears
from worker.model.forward import FAMILIES, FastModel
from worker.model.gguf_q4 import exact_groups
from worker.model.quant import Q4Groups

log = get_logger(__name__)

# Families whose attention goes through transformers' AttentionInterface with full (not
# sliding-window) causal attention; the paged kernel is exact for them.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite", "olmo2"})
FORWARDS = ("fast", "transformers")

# (input_ids [T], positions [T], batch, rows to keep [R]) -> logits [R, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, PagedBatch, torch.Tensor], torch.Tensor]


class ModelLoadError(Exception):
    pass


@dataclass
class LoadedModel:
    model: PreTrainedModel
    forward: Forward
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype_reason: str = ""
    quantization: str = "none"
    forward_name: str = "transformers"
    path: str = ""  # where the weights (and the tokenizer) came from
    fmt: str = ""


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device={requested!r}: CUDA is not available on this machine")
    return device


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def choose_dtype(
    requested: str, device: torch.device, quantization: str = "none"
) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why (logged and reported by GetInfo)."""
    if requested != "auto":
        dtype: torch.dtype = getattr(torch, requested)
        return dtype, f"--dtype {requested}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "--dtype auto: the GPU supports bfloat16"
        return torch.float16, "--dtype auto: the GPU lacks bfloat16"
    if quantization != "none":
        return torch.bfloat16, f"--dtype auto: the {quantization} kernels compute in bfloat16"
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return torch.bfloat16, "--dtype auto: the CPU has AMX (amx_bf16)"
    if "avx512_bf16" in flags:
        # Measured first on a Zen 4 EPYC without AMX (README, Speed): bfloat16 linears ran
        # level with float32 at batch 1 and 1.5-2.5x faster at batch 16-32 (1.2-4x when
        # prepacked), and a SmolLM2 decode step 1.6-1.7x.
        return torch.bfloat16, "--dtype auto: the CPU has AVX512-BF16 (no AMX)"
    return torch.float32, "--dtype auto: the CPU has neither AMX nor AVX512-BF16"


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    return choose_dtype(requested, device)[0]


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
    *,
    quantization: str = "none",
    forward: str = "fast",
    dtype_reason: str = "",
) -> LoadedModel:
    if quantization != "none" and device.type != "cpu":
        raise ModelLoadError(f"quantization={quantization!r}: the low-bit kernels are CPU-only")
    weights = Path(path)
    if not weights.exists():
        raise ModelLoadError(f"model path {path!r} does not exist on this worker")
    if verify_checksum and sha256:
        # Over every file transformers reads here (canteen.models.model_files): weights,
        # config, tokenizer and chat template; a file changed since AddModel is refused.
        actual = weights_sha256(weights)
        if actual != sha256:
            raise ModelLoadError(
                f"checksum mismatch for {path}: registry has {sha256}, file has {actual} "
                "(the sha256 covers weights, config, tokenizer and chat template)"
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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    run, forward = _forward(model, weights if fmt == "gguf" else None, quantization, forward)
    return LoadedModel(
        model=model,
        forward=run,
        device=device,
        dtype=dtype,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        max_model_len=int(config.max_position_embeddings),
        eos_token_ids=_eos_ids(model),
        dtype_reason=dtype_reason,
        quantization=quantization,
        forward_name=forward,
        path=path,
        fmt=fmt,
    )


def _forward(
    model: PreTrainedModel, gguf: Path | None, quantization: str, requested: str
) -> tuple[Forward, str]:
    """Canteen's fused forward where the family is supported exactly, else transformers'."""
    config = model.config
    if requested == "fast" and config.model_type in FAMILIES:
        q4: dict[str, Q4Groups] = {}
        if quantization == "int4" and gguf is not None:
            # Carry the file's own 4-bit values instead of re-quantizing their dequantization.
            params = {name: p.detach() for name, p in model.named_parameters()}
            q4 = exact_groups(gguf, params, config.num_attention_heads, config.num_key_value_heads)
            log.info("int4 from the GGUF's Q4_1 blocks", num_exact_tensors=len(q4))
        return FastModel(model, quantization, q4), "fast"
    if quantization != "none":
        raise ModelLoadError(
            f"quantization={quantization!r} needs Canteen's forward, which does not support "
            f"model_type={config.model_type!r}"
        )
    if requested == "fast":
        log.info("transformers forward for this family", model_type=config.model_type)
    if model.device.type == "cpu":
        use_skinny_linears(model)

    def run(
        input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch, keep: torch.Tensor
    ) -> torch.Tensor:
        out = model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=keep,
            paged_batch=batch,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    return run, "transformers"
