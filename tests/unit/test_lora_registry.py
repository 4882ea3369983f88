"""LoRA adapters in the registry: a model version with a base, its digest over both PEFT
files, checked under --model-root and against the base's shapes; a base is not deleted
while adapters name it; aliases split across adapter versions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from canteen.cli import parse_add_spec
from canteen.models import adapter_sha256
from canteen.v1 import registry_pb2 as pb
from registry.aliases import Alias, AliasTarget
from registry.codec import record_from_pb, record_to_pb
from registry.core import InvalidModelError, ModelInUseError, Registry
from registry.directory import WorkerDirectory
from registry.store import ModelRecord, ModelStore
from tests.support.tiny_model import build_tiny_adapter, build_tiny_model

SMALLER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root holding the tiny base, a smaller model, and adapters of each."""
    root = tmp_path_factory.mktemp("lora-root")
    base = build_tiny_model(root / "base", max_len=512)
    other = build_tiny_model(root / "other", seed=3, num_key_value_heads=1, **SMALLER)
    build_tiny_adapter(base, root / "sql-v1", seed=1)
    build_tiny_adapter(base, root / "sql-v2", seed=2)
    build_tiny_adapter(other, root / "foreign", seed=4)
    return root


async def _registry(root: Path, store: ModelStore | None = None) -> Registry:
    registry = Registry(
        store or ModelStore(":memory:"), WorkerDirectory(10.0), "base", model_roots=(root,)
    )
    await registry.add_model(ModelRecord("base", "v1", "", str(root / "base"), "", 0))
    return registry


def _adapter(root: Path, folder: str, version: str = "v1", base: str = "base:v1") -> ModelRecord:
    return ModelRecord("sql-writer", version, "", str(root / folder), "", 0, base=base)


async def test_an_adapter_is_a_version_with_a_base_and_a_digest_over_both_files(
    root: Path,
) -> None:
    registry = await _registry(root)
    added = await registry.add_model(_adapter(root, "sql-v1"))
    assert (added.format, added.base, added.max_model_len) == ("peft_lora", "base:v1", 512)
    assert added.sha256 == adapter_sha256(root / "sql-v1")
    assert added.path == str((root / "sql-v1").resolve())
    assert registry.store.get("sql-writer") == added
    wire = pb.ModelRecord.FromString(record_to_pb(added).SerializeToString())
    assert (wire.format, wire.base) == (pb.MODEL_FORMAT_PEFT_LORA, "base:v1")
    assert record_from_pb(wire).base == "base:v1"


async def test_an_adapter_of_another_base_is_refused_at_registration(root: Path) -> None:
    registry = await _registry(root)
    with pytest.raises(InvalidModelError) as caught:
        await registry.add_model(_adapter(root, "foreign"))
    assert str(caught.value) == (
        f"path={str(root / 'foreign')!r}: adapter tensor "
        "'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight': shape [4, 64], but "
        "down_proj of base base:v1 has in_features 128; the adapter was made for another base"
    )
    assert [m.name for m in registry.store.list()] == ["base"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            ModelRecord("sql-writer", "v1", "", "sql-v1", "", 0),
            "base='': sql-writer:v1 is a LoRA adapter (adapter_config.json); name its base "
            "model as NAME:VERSION (canteen models add ... --base)",
        ),
        (
            ModelRecord("sql-writer", "v1", "", "sql-v1", "", 0, base="nope:v9"),
            "base='nope:v9': model 'nope:v9' is not registered (known: base:v1)",
        ),
        (
            ModelRecord("sql-writer", "v1", "", "sql-v1", "", 0, base="base"),
            "base='base': use NAME:VERSION of a registered model",
        ),
        (
            ModelRecord("full", "v1", "", "other", "", 0, base="base:v1"),
            "base='base:v1': only a LoRA adapter (a folder with adapter_config.json) has a "
            "base; {root}/other holds a safetensors model",
        ),
    ],
)
async def test_a_base_is_named_exactly_where_it_belongs(
    root: Path, record: ModelRecord, message: str
) -> None:
    registry = await _registry(root)
    record = ModelRecord(
        record.name, record.version, "", str(root / record.path), "", 0, base=record.base
    )
    with pytest.raises(InvalidModelError) as caught:
        await registry.add_model(record)
    assert str(caught.value) == message.format(root=root.resolve())


async def test_an_adapter_cannot_be_the_base_nor_share_a_full_models_name(root: Path) -> None:
    registry = await _registry(root)
    await registry.add_model(_adapter(root, "sql-v1"))
    with pytest.raises(InvalidModelError) as caught:
        await registry.add_model(
            ModelRecord("deeper", "v1", "", str(root / "sql-v2"), "", 0, base="sql-writer:v1")
        )
    assert str(caught.value) == (
        "base='sql-writer:v1': is itself a LoRA adapter; an adapter's base is a full model"
    )
    with pytest.raises(InvalidModelError) as caught:
        await registry.add_model(
            ModelRecord("base", "v2", "", str(root / "sql-v2"), "", 0, base="base:v1")
        )
    assert str(caught.value) == (
        "name='base': its versions are full models; an adapter and a full model never share a name"
    )


async def test_an_adapter_file_outside_the_model_root_is_refused(
    root: Path, tmp_path: Path
) -> None:
    inside = root / "linked"
    inside.mkdir(exist_ok=True)
    (inside / "adapter_model.safetensors").unlink(missing_ok=True)
    (inside / "adapter_config.json").unlink(missing_ok=True)
    (inside / "adapter_model.safetensors").symlink_to(root / "sql-v1" / "adapter_model.safetensors")
    outside = tmp_path / "adapter_config.json"
    outside.write_bytes((root / "sql-v1" / "adapter_config.json").read_bytes())
    (inside / "adapter_config.json").symlink_to(outside)
    registry = await _registry(root)
    with pytest.raises(InvalidModelError) as caught:
        await registry.add_model(_adapter(root, "linked"))
    assert str(caught.value) == (
        f"path={str(inside)!r}: adapter file {inside.resolve()}/adapter_config.json resolves "
        f"to {outside.resolve()}, outside the model roots ({root.resolve()}) (--model-root)"
    )


async def test_a_base_is_not_deleted_while_adapters_name_it(root: Path) -> None:
    registry = await _registry(root)
    await registry.add_model(_adapter(root, "sql-v1"))
    await registry.add_model(_adapter(root, "sql-v2", "v2"))
    with pytest.raises(ModelInUseError) as caught:
        await registry.delete_model("base", "v1")
    assert str(caught.value) == (
        "model base:v1 is the base of LoRA adapter sql-writer:v1, sql-writer:v2; delete "
        "those adapters first"
    )
    await registry.delete_model("sql-writer", "v1")
    await registry.delete_model("sql-writer", "v2")
    await registry.delete_model("base", "v1")
    assert registry.store.list() == []


async def test_an_alias_splits_traffic_across_adapter_versions(root: Path) -> None:
    registry = await _registry(root)
    await registry.add_model(_adapter(root, "sql-v1"))
    await registry.add_model(_adapter(root, "sql-v2", "v2"))
    alias = Alias("sql-writer", "sql-writer", (AliasTarget("v1", 90), AliasTarget("v2", 10)))
    assert await registry.set_alias(alias) == alias
    with pytest.raises(ModelInUseError):
        await registry.delete_model("sql-writer", "v2")


async def test_the_base_survives_a_restart_and_an_old_database_gains_the_column(
    root: Path, tmp_path: Path
) -> None:
    db = tmp_path / "old.db"
    old = sqlite3.connect(db)
    old.executescript(
        "CREATE TABLE models (name TEXT NOT NULL, version TEXT NOT NULL, format TEXT NOT NULL,"
        " path TEXT NOT NULL, sha256 TEXT NOT NULL, max_model_len INTEGER NOT NULL,"
        " created_unix INTEGER NOT NULL, PRIMARY KEY (name, version));"
        "INSERT INTO models VALUES ('legacy', 'v1', 'gguf', '/m.gguf', 'ab', 64, 1);"
    )
    old.close()
    store = ModelStore(str(db))
    assert store.get("legacy").base == ""
    registry = await _registry(root, store)
    await registry.add_model(_adapter(root, "sql-v1"))
    store.close()
    reopened = ModelStore(str(db))
    assert reopened.get("sql-writer", "v1").base == "base:v1"
    assert [a.name for a in reopened.adapters_of("base:v1")] == ["sql-writer"]


def test_models_add_takes_name_version_path_or_the_flags() -> None:
    assert parse_add_spec("sql-writer:v1=/m/sql", "", "") == ("sql-writer", "v1", "/m/sql")
    assert parse_add_spec("/m/sql", "sql-writer", "v1") == ("sql-writer", "v1", "/m/sql")
    with pytest.raises(SystemExit, match="use NAME:VERSION=PATH, or PATH --name N --version V"):
        parse_add_spec("/m/sql", "", "")
    with pytest.raises(SystemExit, match="--name and --version go together"):
        parse_add_spec("/m/sql", "sql-writer", "")
