"""API keys: kept only as sha256 digests, compared in constant time.

A keys file holds one key a line, optionally followed by options that scope it::

    # team keys
    sk-alpha                               all models, the gateway's rate limits
    sk-beta   models=smollm2,tiny          only these models
    sk-gamma  models=tiny rpm=30 tpm=0     and its own limits (0 = unlimited)
    sk-ops    priority=10                  may ask for priority up to 10 (default ceiling: 0)

The environment form is a comma-separated list of plain keys (all models, default limits).
A key is known by its id, the first 8 hex digits of its sha256 digest, so logs and error
messages can name a key without revealing it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from canteen.plan import MAX_PRIORITY, MIN_PRIORITY

T = TypeVar("T")

_OPTIONS = ("models", "rpm", "tpm", "priority")
_OPTIONS_TEXT = "options are models=, rpm=, tpm= and priority="


class PriorityNotAllowedError(PermissionError):
    """The request asks for more priority than its key may (gRPC PERMISSION_DENIED, 403)."""

    def __init__(self, key_id: str, asked: int, ceiling: int) -> None:
        super().__init__(
            f"priority={asked}: API key {key_id} may ask for at most {ceiling} "
            "(priority= in the keys file)"
        )


class AuthenticationError(Exception):
    """The request carries no valid API key (gRPC UNAUTHENTICATED, HTTP 401)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ModelNotAllowedError(PermissionError):
    """The key is valid but may not use the model (gRPC PERMISSION_DENIED, HTTP 403)."""

    def __init__(self, key_id: str, model: str, allowed: frozenset[str]) -> None:
        names = ", ".join(sorted(allowed)) or "none"
        super().__init__(f"API key {key_id} may not use model {model!r} (allowed: {names})")
        self.key_id = key_id
        self.model = model
        self.allowed = allowed


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key id, the models it may use and its own rate limits."""

    key_id: str
    """First 8 hex digits of the key's sha256 digest; safe to log."""
    models: frozenset[str] | None = None
    """Model names the key may use; None for all."""
    rpm: int | None = None
    """Requests per minute for this key; None for the gateway's default, 0 for unlimited."""
    tpm: int | None = None
    """Tokens per minute for this key; None for the gateway's default, 0 for unlimited."""
    max_priority: int | None = None
    """Highest priority the key's requests may ask for; None: no ceiling (no keys)."""

    def require_priority(self, priority: int) -> None:
        """Raises PriorityNotAllowedError when ``priority`` is above the key's ceiling."""
        if self.max_priority is not None and priority > self.max_priority:
            raise PriorityNotAllowedError(self.key_id, priority, self.max_priority)

    def allows(self, model: str) -> bool:
        """Whether the key may use ``model`` (a name, or a ``name:version`` ref)."""
        if self.models is None:
            return True
        return model in self.models or model.rpartition(":")[0] in self.models

    def require_model(self, model: str) -> None:
        """Raises ModelNotAllowedError unless the key may use ``model``."""
        if self.models is not None and not self.allows(model):
            raise ModelNotAllowedError(self.key_id, model, self.models)


ANONYMOUS = Principal(key_id="anonymous")
"""The principal of every request when no API keys are configured."""


@dataclass(frozen=True)
class KeySpec:
    """One configured key and its options, before it is hashed."""

    key: str = field(repr=False)
    models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    priority: int | None = None


def key_id(key: str) -> str:
    """The id that names ``key`` in logs and messages."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_key_line(line: str) -> KeySpec:
    """``KEY [models=a,b] [rpm=N] [tpm=N]`` to a KeySpec; ValueError says what is wrong.

    Messages never quote the key, nor text that might be part of one.
    """
    key, *options = line.split()
    values: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep:
            raise ValueError(
                f"unexpected text after the key (keys cannot contain spaces); {_OPTIONS_TEXT}"
            )
        if name not in _OPTIONS:
            raise ValueError(f"unknown option {name!r}; {_OPTIONS_TEXT}")
        if name in values:
            raise ValueError(f"option {name}= is given twice")
        values[name] = value
    return KeySpec(
        key,
        _parse_models(values["models"]) if "models" in values else None,
        _parse_limit("rpm", values["rpm"]) if "rpm" in values else None,
        _parse_limit("tpm", values["tpm"]) if "tpm" in values else None,
        _parse_priority(values["priority"]) if "priority" in values else None,
    )


def _parse_priority(value: str) -> int:
    try:
        priority = int(value)
    except ValueError:
        priority = MAX_PRIORITY + 1
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(
            f"priority={value!r}: must be a whole number in {MIN_PRIORITY}..{MAX_PRIORITY}"
        )
    return priority


def _parse_models(value: str) -> frozenset[str]:
    names = [n.strip() for n in value.split(",")]
    if not value or not all(names):
        raise ValueError(f"models={value!r}: must be a comma-separated list of model names")
    return frozenset(names)


def _parse_limit(name: str, value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: must be a whole number >= 0 (0 = unlimited)")
    return int(value)


def read_key_lines(keys_file: str, flag: str, parse: Callable[[str], T]) -> list[T]:
    """Each key line of ``keys_file`` parsed (blank lines and ``#`` comments skipped); a
    bad line's error names ``flag``, the file and the line number, never the key."""
    path = Path(keys_file)
    if not path.is_file():
        raise ValueError(f"{flag}={keys_file!r}: no such file")
    parsed = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            parsed.append(parse(line))
        except ValueError as exc:
            raise ValueError(f"{flag}={keys_file!r} line {number}: {exc}") from None
    return parsed


class ApiKeys:
    """The configured keys; ``authenticate`` turns an authorization header into a Principal."""

    def __init__(self, keys: Iterable[str | KeySpec]) -> None:
        self._entries: list[tuple[bytes, Principal]] = []
        by_id: dict[str, tuple[bytes, Principal]] = {}
        for item in keys:
            spec = KeySpec(item) if isinstance(item, str) else item
            if not spec.key:
                continue
            digest = hashlib.sha256(spec.key.encode()).digest()
            ceiling = spec.priority if spec.priority is not None else 0
            principal = Principal(digest.hex()[:8], spec.models, spec.rpm, spec.tpm, ceiling)
            known = by_id.get(principal.key_id)
            if known is None:
                by_id[principal.key_id] = (digest, principal)
                self._entries.append((digest, principal))
            elif known[0] != digest:
                raise ValueError(f"two API keys share the key id {principal.key_id}; replace one")
            elif known[1] != principal:
                raise ValueError(f"API key {principal.key_id} is listed twice with other options")

    @classmethod
    def load(cls, keys_file: str, keys_env: str) -> ApiKeys:
        """Keys from the comma-separated ``keys_env`` and the lines of ``keys_file``."""
        keys: list[str | KeySpec] = [k.strip() for k in keys_env.split(",") if k.strip()]
        if keys_file:
            keys += read_key_lines(keys_file, "api_keys_file", parse_key_line)
        try:
            return cls(keys)
        except ValueError as exc:
            raise ValueError(f"api keys: {exc}") from None

    @property
    def is_enabled(self) -> bool:
        return bool(self._entries)

    @property
    def principals(self) -> list[Principal]:
        """Every configured key's principal, in the order configured."""
        return [principal for _, principal in self._entries]

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an ``authorization`` header; raises AuthenticationError.

        Returns ANONYMOUS when no keys are configured.
        """
        if not self.is_enabled:
            return ANONYMOUS
        if not authorization:
            raise AuthenticationError(
                "missing authorization metadata; send 'authorization: Bearer KEY'"
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("authorization must be 'Bearer KEY'")
        digest = hashlib.sha256(key.strip().encode()).digest()
        found: Principal | None = None
        for known, principal in self._entries:  # no early exit: timing says nothing
            if hmac.compare_digest(digest, known):
                found = principal
        if found is None:
            raise AuthenticationError("invalid API key")
        return found

    def check(self, authorization: str | None) -> str | None:
        """None when the header carries a valid key, else the reason it does not."""
        try:
            self.authenticate(authorization)
        except AuthenticationError as exc:
            return exc.reason
        return None
