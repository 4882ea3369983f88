"""API keys: kept only as sha256 digests, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]

    @classmethod
    def load(cls, keys_file: str, keys_env: str) -> ApiKeys:
        keys = [k.strip() for k in keys_env.split(",") if k.strip()]
        if keys_file:
            path = Path(keys_file)
            if not path.is_file():
                raise ValueError(f"api_keys_file={keys_file!r}: no such file")
            for line in path.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return cls(keys)

    @property
    def is_enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """None when the header carries a valid key, else the reason it does not."""
        if not self.is_enabled:
            return None
        if not authorization:
            return "missing authorization metadata; send 'authorization: Bearer KEY'"
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "authorization must be 'Bearer KEY'"
        digest = hashlib.sha256(key.strip().encode()).digest()
        if any(hmac.compare_digest(digest, known) for known in self._digests):
            return None
        return "invalid API key"
