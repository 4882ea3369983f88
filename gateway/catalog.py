"""The gateway's cached view of the registry's models, kept fresh by its watch stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from canteen.logging import get_logger
from canteen.streams import follow_stream
from canteen.v1 import registry_pb2, registry_pb2_grpc

log = get_logger(__name__)


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    format: str
    path: str
    max_model_len: int

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"


class UnknownModelError(LookupError):
    pass


_FORMATS = {
    registry_pb2.MODEL_FORMAT_GGUF: "gguf",
    registry_pb2.MODEL_FORMAT_SAFETENSORS: "safetensors",
}


class ModelCatalog:
    def __init__(self, registry_address: str) -> None:
        self._address = registry_address
        self._latest: dict[str, ModelVersion] = {}
        self._versions: dict[str, ModelVersion] = {}
        self.default_model = ""
        self.loaded = asyncio.Event()

    def models(self) -> list[ModelVersion]:
        return sorted(self._latest.values(), key=lambda m: m.name)

    def resolve(self, requested: str) -> ModelVersion:
        """A name, ``name:version`` or empty (the default model) to one model version."""
        wanted = requested or self.default_model
        found = self._versions.get(wanted) if ":" in wanted else self._latest.get(wanted)
        if found is None:
            known = ", ".join(m.name for m in self.models()) or "none"
            raise UnknownModelError(f"model {wanted!r} is not registered (available: {known})")
        return found

    def _apply(self, msg: registry_pb2.ListModelsRegistryResponse) -> None:
        latest: dict[str, ModelVersion] = {}
        versions: dict[str, ModelVersion] = {}
        for record in msg.models:  # ordered by name, then creation time
            model = ModelVersion(
                record.name,
                record.version,
                _FORMATS.get(record.format, ""),
                record.path,
                record.max_model_len,
            )
            latest[model.name] = model
            versions[model.ref] = model
        self._latest, self._versions = latest, versions
        self.default_model = msg.default_model

    async def watch_forever(self) -> None:
        await follow_stream(
            self._address,
            lambda channel: registry_pb2_grpc.RegistryStub(channel).WatchModels(
                registry_pb2.WatchModelsRequest()
            ),
            self._on_models,
            "registry models",
        )

    async def _on_models(self, msg: registry_pb2.ListModelsRegistryResponse) -> None:
        self._apply(msg)
        self.loaded.set()
