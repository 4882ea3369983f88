"""Loads one model version for paged serving: device, dtype, checksum, model family, forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from canteen.logging import get_logger
from canteen.models import weights_sha256
from worker import kernels
from worker.attention.interface import ATTENTION_NAME, PagedBatch
from worker.model.fast_linear import use_skinny_linears
from worker.model.forward import FAMILIES, FastModel
from worker.model.gguf_q4 import exact_groups, linear_formats
from worker.model.quant import Groups

log = get_logger(__name__)

# Families whose attention goes through transformers' AttentionInterface with full (not
# sliding-window) causal attention; the paged kernel is exact for them.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite", "olmo2"})
FORWARDS = ("fast", "transformers")

# (input_ids [T], positions [T], batch, rows to keep [R] or None: all) -> logits [R, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, PagedBatch, torch.Tensor | None], torch.Tensor]


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


# --quantization auto: the low-bit mode whose kernel carries a GGUF's linears exactly as shipped.
_AUTO_FROM_GGUF = {"Q4_1": "int4", "Q8_0": "int8"}


def choose_quantization(
    requested: str, path: str, fmt: str, device: torch.device, dtype: str = "auto"
) -> tuple[str, str]:
    """The quantization to load with, and why (logged, and reported by GetInfo with the dtype's
    reason). ``auto`` serves a GGUF whose decoder linears all ship Q4_1 at int4 and all Q8_0
    at int8, their values as they are; anything else in its own dtype (none)."""
    if requested != "auto":
        return requested, f"--quantization {requested}"
    if device.type != "cpu":
        return "none", "--quantization auto: the low-bit kernels are CPU-only"
    if dtype not in ("auto", "bfloat16"):
        return (
            "none",
            f"--quantization auto: --dtype {dtype} (the low-bit kernels compute in bfloat16)",
        )
    if not kernels.quant_vectorized():
        return "none", "--quantization auto: Canteen's low-bit kernel is not vectorized here"
    if not {"avx512_bf16", "amx_bf16"} & cpu_flags():
        # Measured faster than the dtype default only with bfloat16 dot products in hardware;
        # an AVX2 CPU runs float32 by default and keeps it (--quantization int4 still works).
        return "none", "--quantization auto: this CPU has no AVX512-BF16 (its default is faster)"
    if fmt != "gguf":
        return (
            "none",
            f"--quantization auto: a {fmt or 'non-GGUF'} checkpoint runs in its own dtype",
        )
    try:
        kinds = linear_formats(Path(path))
    except (OSError, ValueError) as exc:
        return "none", f"--quantization auto: the GGUF's tensor types could not be read ({exc})"
    shipped = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    if len(kinds) == 1 and (kind := next(iter(kinds))) in _AUTO_FROM_GGUF:
        chosen = _AUTO_FROM_GGUF[kind]
        return (
            chosen,
            f"--quantization auto: the GGUF's linears ship {shipped}; {chosen} as shipped",
        )
    shipped = shipped or "no linears"
    return "none", f"--quantization auto: the GGUF's linears ship {shipped}, not all Q4_1 or Q8_0"


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
        q4: dict[str, Groups] = {}
        if quantization in ("int4", "int8") and gguf is not None:
            # Carry the file's own low-bit values instead of re-quantizing their dequantization.
            params = {name: p.detach() for name, p in model.named_parameters()}
            params["lm_head.weight"] = model.lm_head.weight.detach()  # tied or not
            q4 = exact_groups(gguf, params, config.num_attention_heads, config.num_key_value_heads)
            kinds = sorted({type(g).__name__ for g in q4.values()})
            log.info(
                f"{quantization} from the GGUF's own blocks", num_exact_tensors=len(q4), kinds=kinds
            )
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
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        out = model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=0 if keep is None else keep,  # 0: every row
            paged_batch=batch,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    return run, "transformers"
