"""Admin key scopes over real processes: the gateway's key reads /status, never writes."""

from __future__ import annotations

import grpc
import httpx
import pytest

from canteen.auth import key_id
from canteen.tls import sync_channel
from canteen.v1 import registry_pb2, registry_pb2_grpc
from tests.security.conftest import GATEWAY_ADMIN_FILE, SecureSuite


def _gateway_key(secure: SecureSuite) -> str:
    """The key exactly as the gateway holds it, from its own admin keys file."""
    (line,) = (secure.suite.workdir / GATEWAY_ADMIN_FILE).read_text().splitlines()
    return line.split()[0]


def test_the_gateways_admin_key_cannot_write_to_the_registry(secure: SecureSuite) -> None:
    key = _gateway_key(secure)
    metadata = (("authorization", f"Bearer {key}"),)
    alias = registry_pb2.Alias(name="tiny", targets=[registry_pb2.AliasTarget(version="v1")])
    model = registry_pb2.ModelRecord(name="tiny", version="v9", path=str(secure.model_dir))
    channel = sync_channel(secure.registry.address, secure.tls("client"), "registry")
    with channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        for name, call, request in (
            ("AddModel", stub.AddModel, registry_pb2.AddModelRequest(model=model)),
            (
                "DeleteModel",
                stub.DeleteModel,
                registry_pb2.DeleteModelRequest(name="tiny", version="v1"),
            ),
            ("SetAlias", stub.SetAlias, registry_pb2.SetAliasRequest(alias=alias)),
            ("DeleteAlias", stub.DeleteAlias, registry_pb2.DeleteAliasRequest(name="tiny")),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert info.value.details() == (
                f"admin key {key_id(key)} has scope=read: {name} needs an admin key with "
                "scope=write"
            )
        listed = stub.ListModels(registry_pb2.ListModelsRegistryRequest(), timeout=10)
    assert [f"{m.name}:{m.version}" for m in listed.models] == ["tiny:v1"]
    # The same key is all the gateway's /status needs.
    url = f"{secure.shared.http_url}/status.json"
    response = httpx.get(url, headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200
    assert response.json()["scheduler"] == "ok"
