"""Registry writes: an admin key, paths under the model roots, the registry's own sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest

from canteen.models import weights_sha256
from canteen.tls import sync_channel
from canteen.v1 import registry_pb2, registry_pb2_grpc
from tests.security.conftest import SecureSuite
from tests.support.suite import ADMIN_KEY

ADMIN = (("authorization", f"Bearer {ADMIN_KEY}"),)


def _stub(secure: SecureSuite) -> tuple[grpc.Channel, registry_pb2_grpc.RegistryStub]:
    channel = sync_channel(secure.registry.address, secure.tls("client"), "registry")
    return channel, registry_pb2_grpc.RegistryStub(channel)


def _add(path: Path | str, version: str, sha256: str = "") -> registry_pb2.AddModelRequest:
    return registry_pb2.AddModelRequest(
        model=registry_pb2.ModelRecord(name="tiny", version=version, path=str(path), sha256=sha256)
    )


def _versions(stub: registry_pb2_grpc.RegistryStub) -> set[str]:
    listed = stub.ListModels(registry_pb2.ListModelsRegistryRequest(), timeout=10)
    return {f"{m.name}:{m.version}" for m in listed.models}


def test_writes_without_the_admin_key_are_refused(secure: SecureSuite) -> None:
    channel, stub = _stub(secure)
    with channel:
        for metadata in ((), (("authorization", "Bearer not-the-key"),)):
            for call, request in (
                (stub.AddModel, _add(secure.model_dir, "v9")),
                (stub.DeleteModel, registry_pb2.DeleteModelRequest(name="tiny", version="v1")),
                (
                    stub.SetAlias,
                    registry_pb2.SetAliasRequest(
                        alias=registry_pb2.Alias(
                            name="tiny", targets=[registry_pb2.AliasTarget(version="v1", weight=1)]
                        )
                    ),
                ),
                (stub.DeleteAlias, registry_pb2.DeleteAliasRequest(name="tiny")),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
                assert (info.value.details() or "").startswith("admin key: ")
        assert _versions(stub) == {"tiny:v1"}


def test_a_model_path_outside_the_model_root_is_refused(
    secure: SecureSuite, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model.gguf").write_bytes(b"GGUF not really")
    link = secure.model_root / "escape"  # a symlink inside the root pointing out of it
    link.symlink_to(outside)
    channel, stub = _stub(secure)
    with channel:
        for path in (outside / "model.gguf", "/etc/passwd", link / "model.gguf"):
            with pytest.raises(grpc.RpcError) as info:
                stub.AddModel(_add(path, "evil"), timeout=30, metadata=ADMIN)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "outside the registry's model roots" in (info.value.details() or "")
        assert _versions(stub) == {"tiny:v1"}
    link.unlink()


def test_the_registry_computes_the_sha256_and_refuses_a_wrong_one(secure: SecureSuite) -> None:
    actual = weights_sha256(secure.model_dir)
    wrong = hashlib.sha256(b"something else").hexdigest()
    channel, stub = _stub(secure)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            stub.AddModel(_add(secure.model_dir, "v2", sha256=wrong), timeout=60, metadata=ADMIN)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sha256={wrong!r}: the weights at" in (info.value.details() or "")
        added = stub.AddModel(_add(secure.model_dir, "v2"), timeout=60, metadata=ADMIN)
        assert added.sha256 == actual
        assert "tiny:v2" in _versions(stub)
        stub.DeleteModel(
            registry_pb2.DeleteModelRequest(name="tiny", version="v2"), timeout=10, metadata=ADMIN
        )
        assert _versions(stub) == {"tiny:v1"}
        with pytest.raises(grpc.RpcError) as missing:
            stub.DeleteModel(
                registry_pb2.DeleteModelRequest(name="tiny", version="v2"),
                timeout=10,
                metadata=ADMIN,
            )
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "model 'tiny:v2' is not registered (known: tiny:v1)" in (
            missing.value.details() or ""
        )
