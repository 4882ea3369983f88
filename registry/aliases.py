"""Aliases: a name that resolves to versions of one model by weight, and their validation.

An alias may carry its own model's name: ``smollm2 -> v1=90, v2=10`` makes requests that
name ``smollm2`` split 90/10, while ``smollm2:v2`` still pins one version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from canteen.models import MAX_ALIAS_WEIGHT as MAX_WEIGHT


@dataclass(frozen=True)
class AliasTarget:
    version: str
    weight: int


@dataclass(frozen=True)
class Alias:
    name: str
    model: str
    targets: tuple[AliasTarget, ...]


class InvalidAliasError(ValueError):
    pass


class AliasTargetNotFoundError(LookupError):
    """The alias names a model or version that is not registered."""


def check_alias_shape(alias: Alias) -> None:
    """Checks what needs no model table: names, weights, duplicates."""
    if not alias.name or ":" in alias.name:
        raise InvalidAliasError(f"name={alias.name!r}: must be non-empty without ':'")
    if not alias.model:
        raise InvalidAliasError("model='': must name a registered model")
    if not alias.targets:
        raise InvalidAliasError(f"alias {alias.name!r}: targets must have at least one version")
    seen: set[str] = set()
    for i, target in enumerate(alias.targets):
        if not target.version:
            raise InvalidAliasError(f"targets[{i}].version='': must name a version")
        if not 1 <= target.weight <= MAX_WEIGHT:
            raise InvalidAliasError(
                f"targets[{i}].weight={target.weight} (version {target.version!r}): "
                f"must be in 1..{MAX_WEIGHT}"
            )
        if target.version in seen:
            raise InvalidAliasError(
                f"targets[{i}].version={target.version!r}: listed more than once"
            )
        seen.add(target.version)


def check_alias(alias: Alias, versions: Mapping[str, Iterable[str]]) -> None:
    """Checks an alias against the registered versions (``versions``: model -> versions).

    Raises InvalidAliasError for a malformed alias or one whose name is another model's, and
    AliasTargetNotFoundError for a model or version that is not registered.
    """
    check_alias_shape(alias)
    if alias.name != alias.model and alias.name in versions:
        raise InvalidAliasError(
            f"name={alias.name!r}: is a registered model; an alias may take only its own "
            f"model's name ({alias.model!r})"
        )
    if alias.model not in versions:
        known = ", ".join(sorted(versions)) or "none"
        raise AliasTargetNotFoundError(f"model={alias.model!r}: is not registered (known: {known})")
    registered = set(versions[alias.model])
    for i, target in enumerate(alias.targets):
        if target.version not in registered:
            known = ", ".join(sorted(registered))
            raise AliasTargetNotFoundError(
                f"targets[{i}].version={target.version!r}: model {alias.model!r} has no such "
                f"version (known: {known})"
            )
