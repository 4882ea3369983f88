"""Model records and aliases in SQLite (WAL mode, one transaction per write)."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from registry.aliases import Alias, AliasTarget

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    format TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    max_model_len INTEGER NOT NULL,
    created_unix INTEGER NOT NULL,
    base TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS alias_targets (
    alias TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    weight INTEGER NOT NULL,
    position INTEGER NOT NULL,
    PRIMARY KEY (alias, version)
);
"""


@dataclass(frozen=True)
class ModelRecord:
    name: str
    version: str
    format: str
    path: str
    sha256: str
    max_model_len: int
    created_unix: int = 0
    base: str = ""  # a LoRA adapter's base model, "name:version"; "" for a full model


class ModelExistsError(Exception):
    pass


class ModelNotFoundError(Exception):
    pass


class AliasNotFoundError(LookupError):
    pass


class ModelStore:
    """The model and alias tables. ``path=":memory:"`` keeps them in memory (tests)."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(models)")}
        if "base" not in columns:  # a registry database from before LoRA adapters
            self._db.execute("ALTER TABLE models ADD COLUMN base TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        self._db.close()

    def add(self, record: ModelRecord) -> ModelRecord:
        created = record.created_unix or int(time.time())
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(
                    "INSERT INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.name,
                        record.version,
                        record.format,
                        record.path,
                        record.sha256,
                        record.max_model_len,
                        created,
                        record.base,
                    ),
                )
        except sqlite3.IntegrityError as exc:
            raise ModelExistsError(
                f"model {record.name}:{record.version} is already registered"
            ) from exc
        return self.get(record.name, record.version)

    def get(self, name: str, version: str = "") -> ModelRecord:
        if version:
            row = self._db.execute(
                "SELECT * FROM models WHERE name = ? AND version = ?", (name, version)
            ).fetchone()
        else:
            row = self._db.execute(
                "SELECT * FROM models WHERE name = ? "
                "ORDER BY created_unix DESC, rowid DESC LIMIT 1",
                (name,),
            ).fetchone()
        if row is None:
            wanted = f"{name}:{version}" if version else name
            known = ", ".join(f"{r.name}:{r.version}" for r in self.list()) or "none"
            raise ModelNotFoundError(f"model {wanted!r} is not registered (known: {known})")
        return ModelRecord(*row)

    def delete(self, name: str, version: str) -> None:
        """Removes one model version; ModelNotFoundError if it is not there."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            deleted = self._db.execute(
                "DELETE FROM models WHERE name = ? AND version = ?", (name, version)
            )
        if deleted.rowcount == 0:
            known = ", ".join(f"{r.name}:{r.version}" for r in self.list()) or "none"
            raise ModelNotFoundError(f"model '{name}:{version}' is not registered (known: {known})")

    def set_alias(self, alias: Alias) -> Alias:
        """Stores an alias (checked by the caller), replacing its previous targets."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM alias_targets WHERE alias = ?", (alias.name,))
            self._db.executemany(
                "INSERT INTO alias_targets VALUES (?, ?, ?, ?, ?)",
                [
                    (alias.name, alias.model, t.version, t.weight, i)
                    for i, t in enumerate(alias.targets)
                ],
            )
        return alias

    def delete_alias(self, name: str) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            deleted = self._db.execute("DELETE FROM alias_targets WHERE alias = ?", (name,))
        if deleted.rowcount == 0:
            known = ", ".join(a.name for a in self.aliases()) or "none"
            raise AliasNotFoundError(f"alias {name!r} does not exist (known: {known})")

    def aliases(self) -> list[Alias]:
        """Every alias, by name, with its targets in the order they were given."""
        rows = self._db.execute(
            "SELECT alias, model, version, weight FROM alias_targets ORDER BY alias, position"
        ).fetchall()
        grouped: dict[str, tuple[str, list[AliasTarget]]] = {}
        for alias, model, version, weight in rows:
            grouped.setdefault(alias, (model, []))[1].append(AliasTarget(version, weight))
        return [Alias(name, model, tuple(ts)) for name, (model, ts) in grouped.items()]

    def adapters_of(self, base: str) -> list[ModelRecord]:
        """The LoRA adapters whose base is ``base`` ("name:version")."""
        rows = self._db.execute(
            "SELECT * FROM models WHERE base = ? ORDER BY name, created_unix, rowid", (base,)
        ).fetchall()
        return [ModelRecord(*row) for row in rows]

    def versions(self) -> dict[str, list[str]]:
        """Registered versions by model name."""
        found: dict[str, list[str]] = {}
        for record in self.list():
            found.setdefault(record.name, []).append(record.version)
        return found

    def list(self) -> list[ModelRecord]:
        rows = self._db.execute(
            "SELECT * FROM models ORDER BY name, created_unix, rowid"
        ).fetchall()
        return [ModelRecord(*row) for row in rows]
