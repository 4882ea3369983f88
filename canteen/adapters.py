"""LoRA adapters as requests and sequences carry them (``AdapterRef`` in common.proto).

An adapter is a registry model version with a base: a PEFT folder holding
``adapter_config.json`` and ``adapter_model.safetensors``. The gateway resolves a request's
model name to one, the scheduler carries it with the sequence (it is part of the sequence's
prefix-cache key), and the worker loads it on demand and checks the digest.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterRef:
    name: str
    version: str
    path: str  # the PEFT folder, under the worker's --model-root
    sha256: str  # hex, over both files, as the registry recorded it

    @property
    def id(self) -> str:
        """``name:version``: how workers, metrics and the prefix cache name the adapter."""
        return f"{self.name}:{self.version}"
