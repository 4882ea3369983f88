"""Model records in SQLite (WAL mode, one transaction per write)."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    format TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    max_model_len INTEGER NOT NULL,
    created_unix INTEGER NOT NULL,
    PRIMARY KEY (name, version)
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


class ModelExistsError(Exception):
    pass


class ModelNotFoundError(Exception):
    pass


class ModelStore:
    """The model table. ``path=":memory:"`` keeps it in memory (tests)."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def add(self, record: ModelRecord) -> ModelRecord:
        created = record.created_unix or int(time.time())
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(
                    "INSERT INTO models VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.name,
                        record.version,
                        record.format,
                        record.path,
                        record.sha256,
                        record.max_model_len,
                        created,
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

    def list(self) -> list[ModelRecord]:
        rows = self._db.execute(
            "SELECT * FROM models ORDER BY name, created_unix, rowid"
        ).fetchall()
        return [ModelRecord(*row) for row in rows]
