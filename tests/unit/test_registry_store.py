"""Model records in SQLite: persisted, unique, and clear about what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.store import ModelExistsError, ModelNotFoundError, ModelRecord, ModelStore


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
