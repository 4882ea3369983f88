"""Model files: the digest covers config, tokenizer and chat template as well as the weights,
and the registry refuses any model file that resolves outside its --model-root."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from canteen.models import model_files, weights_sha256
from registry.core import InvalidModelError, Registry
from registry.directory import WorkerDirectory
from registry.store import ModelRecord, ModelStore


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text('{"max_position_embeddings": 256}')
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "README.md").write_text("notes")
    return folder


def _registry(root: Path) -> Registry:
    return Registry(ModelStore(":memory:"), WorkerDirectory(10.0), "m", model_roots=(root,))


def test_the_digest_covers_tokenizer_config_and_chat_template(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    assert [p.name for p in model_files(model)] == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    before = weights_sha256(model)
    (model / "README.md").write_text("other notes")  # not read by anyone: same model
    assert weights_sha256(model) == before
    for name, text in (
        ("tokenizer.json", '{"model": {"vocab": {"b": 0}}}'),
        ("chat_template.jinja", "{{ evil }}"),
        ("config.json", '{"max_position_embeddings": 512}'),
    ):
        original = (model / name).read_text()
        (model / name).write_text(text)
        assert weights_sha256(model) != before, name
        (model / name).write_text(original)
        assert weights_sha256(model) == before, name


async def test_the_registry_records_the_digest_of_every_model_file(tmp_path: Path) -> None:
    model = _model(tmp_path / "root" / "m")
    registry = _registry(tmp_path / "root")
    added = await registry.add_model(ModelRecord("m", "v1", "", str(model), "", 0))
    assert added.sha256 == weights_sha256(model)
    assert added.max_model_len == 256


async def test_a_tokenizer_symlinked_out_of_the_model_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = _model(root / "m")
    outside = tmp_path / "elsewhere" / "tokenizer.json"
    outside.parent.mkdir()
    outside.write_text('{"model": {"vocab": {"x": 0}}}')
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(outside)
    registry = _registry(root)
    with pytest.raises(InvalidModelError) as info:
        await registry.add_model(ModelRecord("m", "v1", "", str(model), "", 0))
    assert str(info.value) == (
        f"path={str(model)!r}: model file {model / 'tokenizer.json'} resolves to {outside}, "
        f"outside the model roots ({root.resolve()}; --model-root): every model file "
        "(weights, config, tokenizer, chat template) must lie under one"
    )
    assert registry.store.list() == []


def test_the_worker_refuses_a_model_whose_tokenizer_changed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import torch

    from worker.model.loader import ModelLoadError, load_model

    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, copy)
    recorded = weights_sha256(copy)
    tokenizer = copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # one byte more is another model
    actual = weights_sha256(copy)
    assert actual != recorded
    with pytest.raises(ModelLoadError) as info:
        load_model(str(copy), "safetensors", recorded, torch.device("cpu"), torch.float32)
    assert str(info.value) == (
        f"checksum mismatch for {copy}: registry has {recorded}, file has {actual} "
        "(the sha256 covers weights, config, tokenizer and chat template)"
    )
