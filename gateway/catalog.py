"""The gateway's cached view of the registry's models and aliases, kept fresh by its watch
stream (no polling).

    requested          resolves to
    ""                 the default model's name, then as below
    "name:version"     exactly that version
    "name" (alias)     one of the alias's versions, drawn by weight
    "name"             the model's latest version

A LoRA adapter (a registry record with a base) resolves like any model; its ``base`` is the
full model whose workers serve it, whose tokenizer reads its prompts, and whose context it
has. An adapter whose base the snapshot lacks is left out.
"""

from __future__ import annotations

import asyncio
import bisect
import random
from dataclasses import dataclass

from canteen.adapters import AdapterRef
from canteen.logging import get_logger
from canteen.streams import follow_stream
from canteen.tls import Tls, aio_channel
from canteen.v1 import registry_pb2, registry_pb2_grpc

log = get_logger(__name__)


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    format: str
    path: str
    max_model_len: int
    sha256: str = ""
    base: ModelVersion | None = None  # a LoRA adapter's base model; None for a full model

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.version}"

    @property
    def served(self) -> ModelVersion:
        """The full model that runs it: its base for an adapter, else itself."""
        return self.base or self

    @property
    def adapter(self) -> AdapterRef | None:
        """What requests carry to run it: None for a full model."""
        if self.base is None:
            return None
        return AdapterRef(self.name, self.version, self.path, self.sha256)


@dataclass(frozen=True)
class WeightedRoute:
    """An alias ready to draw from: its versions and the running sums of their weights."""

    name: str
    targets: tuple[ModelVersion, ...]
    cum_weights: tuple[int, ...]

    def pick(self, rng: random.Random) -> ModelVersion:
        # integer draw: exact shares, no float rounding at the edges
        point = rng.randrange(self.cum_weights[-1])
        return self.targets[bisect.bisect_right(self.cum_weights, point)]


class UnknownModelError(LookupError):
    pass


_FORMATS = {
    registry_pb2.MODEL_FORMAT_GGUF: "gguf",
    registry_pb2.MODEL_FORMAT_SAFETENSORS: "safetensors",
    registry_pb2.MODEL_FORMAT_PEFT_LORA: "peft_lora",
}


class ModelCatalog:
    def __init__(
        self, registry_address: str, tls: Tls | None = None, rng: random.Random | None = None
    ) -> None:
        self._address = registry_address
        self._tls = tls
        self._rng = rng or random.Random()
        self._latest: dict[str, ModelVersion] = {}
        self._versions: dict[str, ModelVersion] = {}
        self._routes: dict[str, WeightedRoute] = {}
        self.default_model = ""
        self.loaded = asyncio.Event()

    def models(self) -> list[ModelVersion]:
        return sorted(self._latest.values(), key=lambda m: m.name)

    def aliases(self) -> list[WeightedRoute]:
        return sorted(self._routes.values(), key=lambda r: r.name)

    def resolve(self, requested: str) -> ModelVersion:
        """A name, ``name:version`` or empty (the default model) to one model version."""
        wanted = requested or self.default_model
        if ":" in wanted:
            found = self._versions.get(wanted)
        elif (route := self._routes.get(wanted)) is not None:
            found = route.pick(self._rng)
        else:
            found = self._latest.get(wanted)
        if found is None:
            names = sorted({*self._latest, *self._routes})
            known = ", ".join(names) or "none"
            shown = repr(wanted) if len(wanted) <= 64 else repr(wanted[:61] + "...")
            raise UnknownModelError(f"model {shown} is not registered (available: {known})")
        return found

    def apply(self, msg: registry_pb2.ListModelsRegistryResponse) -> None:
        """Replaces the cached table with one snapshot from the registry."""
        latest: dict[str, ModelVersion] = {}
        versions: dict[str, ModelVersion] = {}
        full = {f"{r.name}:{r.version}" for r in msg.models if not r.base}
        # ordered by name, then creation time; full models first: adapters name them
        for record in sorted(msg.models, key=lambda r: bool(r.base)):
            if record.base and record.base not in full:
                log.warning(
                    "adapter skipped: base not listed", adapter=record.name, base=record.base
                )
                continue
            model = ModelVersion(
                record.name,
                record.version,
                _FORMATS.get(record.format, ""),
                record.path,
                record.max_model_len,
                record.sha256,
                versions[record.base] if record.base else None,
            )
            latest[model.name] = model
            versions[model.ref] = model
        routes = {a.name: r for a in msg.aliases if (r := _route(a, versions)) is not None}
        self._latest, self._versions, self._routes = latest, versions, routes
        self.default_model = msg.default_model

    async def watch_forever(self) -> None:
        """Follows the registry's model watch for the life of the gateway."""
        await follow_stream(
            lambda: aio_channel(self._address, self._tls, "registry"),
            lambda channel: registry_pb2_grpc.RegistryStub(channel).WatchModels(
                registry_pb2.WatchModelsRequest()
            ),
            self._on_models,
            "registry models",
        )

    async def _on_models(self, msg: registry_pb2.ListModelsRegistryResponse) -> None:
        self.apply(msg)
        self.loaded.set()


def _route(alias: registry_pb2.Alias, versions: dict[str, ModelVersion]) -> WeightedRoute | None:
    """The alias's drawable form; targets the snapshot lacks are left out (and logged)."""
    targets: list[ModelVersion] = []
    cum_weights: list[int] = []
    for target in alias.targets:
        model = versions.get(f"{alias.model}:{target.version}")
        if model is None or target.weight <= 0:
            log.warning(
                "alias target skipped", alias=alias.name, model=alias.model, version=target.version
            )
            continue
        targets.append(model)
        cum_weights.append((cum_weights[-1] if cum_weights else 0) + target.weight)
    if not targets:
        return None
    return WeightedRoute(alias.name, tuple(targets), tuple(cum_weights))
