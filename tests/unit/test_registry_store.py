"""Model records and aliases in SQLite: persisted, unique, and clear about what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.aliases import Alias, AliasTarget
from registry.store import (
    AliasNotFoundError,
    ModelExistsError,
    ModelNotFoundError,
    ModelRecord,
    ModelStore,
)


def _record(version: str, created: int) -> ModelRecord:
    return ModelRecord("m", version, "gguf", "/w.gguf", "ab" * 32, 2048, created)


def test_records_survive_a_restart(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    store = ModelStore(db)
    store.add(_record("v1", 100))
    store.add(_record("v2", 200))
    store.close()
    reopened = ModelStore(db)
    assert [r.version for r in reopened.list()] == ["v1", "v2"]
    assert reopened.get("m").version == "v2"  # empty version means the latest
    assert reopened.get("m", "v1") == _record("v1", 100)


def test_a_version_is_registered_once(tmp_path: Path) -> None:
    store = ModelStore(str(tmp_path / "r.db"))
    store.add(_record("v1", 1))
    with pytest.raises(ModelExistsError, match="model m:v1 is already registered"):
        store.add(_record("v1", 2))


def test_missing_model_names_what_exists() -> None:
    store = ModelStore(":memory:")
    store.add(_record("v1", 1))
    with pytest.raises(ModelNotFoundError, match=r"'other' is not registered \(known: m:v1\)"):
        store.get("other")
    with pytest.raises(ModelNotFoundError, match="'m:v9'"):
        store.get("m", "v9")


def _alias(name: str, *targets: tuple[str, int]) -> Alias:
    return Alias(name, "m", tuple(AliasTarget(v, w) for v, w in targets))


def test_aliases_survive_a_restart_in_their_given_order(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    store = ModelStore(db)
    store.set_alias(_alias("m", ("v2", 10), ("v1", 90)))
    store.set_alias(_alias("canary", ("v2", 1)))
    store.close()
    reopened = ModelStore(db)
    assert reopened.aliases() == [_alias("canary", ("v2", 1)), _alias("m", ("v2", 10), ("v1", 90))]


def test_setting_an_alias_replaces_its_targets() -> None:
    store = ModelStore(":memory:")
    store.set_alias(_alias("m", ("v1", 90), ("v2", 10)))
    store.set_alias(_alias("m", ("v2", 100)))
    assert store.aliases() == [_alias("m", ("v2", 100))]


def test_deleting_an_alias_names_what_exists() -> None:
    store = ModelStore(":memory:")
    store.set_alias(_alias("m", ("v1", 1)))
    with pytest.raises(AliasNotFoundError, match=r"alias 'x' does not exist \(known: m\)"):
        store.delete_alias("x")
    store.delete_alias("m")
    assert store.aliases() == []


def test_versions_groups_by_model() -> None:
    store = ModelStore(":memory:")
    store.add(_record("v1", 1))
    store.add(_record("v2", 2))
    assert store.versions() == {"m": ["v1", "v2"]}
