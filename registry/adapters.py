"""LoRA adapters as registry records: a model version with a base.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors) registered as
``name:version`` over a registered full model ``base`` ("name:version"). Its checksum covers
both files (canteen.models.adapter_sha256), both must lie under --model-root, every tensor
must fit the base (canteen/adapter_shapes.py), and its context is the base's. One model name
holds adapters or full models, never both, so "the latest version" of a name is one kind.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from canteen.adapter_shapes import check_adapter_fits
from canteen.models import ADAPTER_FILES, adapter_sha256
from registry.store import ModelNotFoundError, ModelRecord, ModelStore

ADAPTER_FORMAT = "peft_lora"


class InvalidAdapterError(ValueError):
    pass


def check_kind(record: ModelRecord, fmt: str, store: ModelStore) -> None:
    """Refuses a base on a full model, an adapter without one, and a name that would hold
    both kinds."""
    is_adapter = fmt == ADAPTER_FORMAT
    if is_adapter and not record.base:
        raise InvalidAdapterError(
            f"base='': {record.name}:{record.version} is a LoRA adapter (adapter_config.json); "
            "name its base model as NAME:VERSION (canteen models add ... --base)"
        )
    if record.base and not is_adapter:
        raise InvalidAdapterError(
            f"base={record.base!r}: only a LoRA adapter (a folder with adapter_config.json) "
            f"has a base; {record.path} holds a {fmt} model"
        )
    for other in store.list():
        if other.name == record.name and (other.format == ADAPTER_FORMAT) != is_adapter:
            kind = "LoRA adapters" if other.format == ADAPTER_FORMAT else "full models"
            raise InvalidAdapterError(
                f"name={record.name!r}: its versions are {kind}; an adapter and a full model "
                "never share a name"
            )


def base_of(record: ModelRecord, store: ModelStore) -> ModelRecord:
    """The registered full model the adapter names as its base."""
    name, sep, version = record.base.partition(":")
    if not sep or not name or not version:
        raise InvalidAdapterError(f"base={record.base!r}: use NAME:VERSION of a registered model")
    try:
        base = store.get(name, version)
    except ModelNotFoundError as exc:
        raise InvalidAdapterError(f"base={record.base!r}: {exc}") from None
    if base.base:
        raise InvalidAdapterError(
            f"base={record.base!r}: is itself a LoRA adapter; an adapter's base is a full model"
        )
    return base


def adapter_files_outside(path: Path, roots: tuple[Path, ...]) -> str | None:
    """Why an adapter file resolves outside every model root (None when all lie under one)."""
    for name in ADAPTER_FILES:
        file = path / name
        real = file.resolve()
        if roots and not any(real.is_relative_to(root) for root in roots):
            names = ", ".join(str(r) for r in roots)
            return f"adapter file {file} resolves to {real}, outside the model roots ({names})"
    return None


async def describe_adapter(record: ModelRecord, path: Path, store: ModelStore) -> ModelRecord:
    """The record to store: checked against its base, with its checksum and the base's
    context length."""
    base = base_of(record, store)
    try:
        sha256 = await asyncio.to_thread(adapter_sha256, path)
        await asyncio.to_thread(check_adapter_fits, path, Path(base.path), record.base)
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidAdapterError(f"path={record.path!r}: {exc}") from None
    if record.sha256 and record.sha256.lower() != sha256:
        raise InvalidAdapterError(
            f"sha256={record.sha256!r}: the adapter files at {path} hash to {sha256}"
        )
    return ModelRecord(
        record.name, record.version, ADAPTER_FORMAT, str(path), sha256, base.max_model_len,
        base=record.base,
    )  # fmt: skip
