"""Alias validation, the registry storing aliases and pushing them to model watchers, and the
status codes its servicer gives for bad ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

import grpc
import pytest

from canteen.auth import ApiKeys
from canteen.v1 import registry_pb2 as pb
from canteen.v1 import registry_pb2_grpc
from registry.aliases import (
    Alias,
    AliasTarget,
    AliasTargetNotFoundError,
    InvalidAliasError,
    check_alias,
)
from registry.core import InvalidModelError, ModelTable, Registry
from registry.directory import WorkerDirectory
from registry.server import RegistryServicer
from registry.store import ModelRecord, ModelStore

VERSIONS = {"smollm2": ["v1", "v2"], "other": ["v1"]}


def alias(name: str, *targets: tuple[str, int], model: str = "smollm2") -> Alias:
    return Alias(name, model, tuple(AliasTarget(v, w) for v, w in targets))


def test_a_canary_on_the_models_own_name_is_valid() -> None:
    check_alias(alias("smollm2", ("v1", 90), ("v2", 10)), VERSIONS)
    check_alias(alias("chat", ("v2", 10_000)), VERSIONS)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (alias("smollm2"), "targets must have at least one version"),
        (
            alias("smollm2", ("v1", 0)),
            r"targets\[0\].weight=0 \(version 'v1'\): must be in 1..10000",
        ),
        (alias("smollm2", ("v1", 1), ("v2", 10_001)), r"targets\[1\].weight=10001"),
        (alias("smollm2", ("v1", -5)), r"targets\[0\].weight=-5"),
        (alias("smollm2", ("v1", 50), ("v1", 50)), r"targets\[1\].version='v1': listed more"),
        (alias("smollm2", ("", 1)), r"targets\[0\].version='': must name a version"),
        (alias("a:b", ("v1", 1)), "name='a:b': must be non-empty without ':'"),
        (alias("other", ("v1", 1)), "name='other': is a registered model"),
    ],
)
def test_malformed_aliases_name_the_field_and_the_limit(bad: Alias, message: str) -> None:
    with pytest.raises(InvalidAliasError, match=message):
        check_alias(bad, VERSIONS)


def test_targets_must_be_registered_versions_of_that_model() -> None:
    with pytest.raises(
        AliasTargetNotFoundError,
        match=r"targets\[1\].version='v9': model 'smollm2' has no such version \(known: v1, v2\)",
    ):
        check_alias(alias("smollm2", ("v1", 1), ("v9", 1)), VERSIONS)
    with pytest.raises(AliasTargetNotFoundError, match=r"model='nope': is not registered"):
        check_alias(alias("nope", ("v1", 1), model="nope"), VERSIONS)


def _registry() -> Registry:
    store = ModelStore(":memory:")
    for version, created in (("v1", 1), ("v2", 2)):
        store.add(ModelRecord("smollm2", version, "gguf", "/w.gguf", "ab" * 32, 2048, created))
    return Registry(store, WorkerDirectory(10.0), "smollm2")


async def test_model_watchers_see_alias_changes() -> None:
    registry = _registry()
    watch = cast(AsyncGenerator[ModelTable, None], registry.watch_models())
    first = await anext(watch)
    assert first.aliases == [] and [m.version for m in first.models] == ["v1", "v2"]
    canary = alias("smollm2", ("v1", 90), ("v2", 10))
    await registry.set_alias(canary)
    assert (await asyncio.wait_for(anext(watch), 5)).aliases == [canary]
    await registry.delete_alias("smollm2")
    assert (await asyncio.wait_for(anext(watch), 5)).aliases == []
    await watch.aclose()


async def test_a_model_cannot_take_the_name_of_another_models_alias() -> None:
    registry = _registry()
    await registry.set_alias(alias("chat", ("v1", 1)))
    with pytest.raises(InvalidModelError, match="name='chat': is an alias of model 'smollm2'"):
        await registry.add_model(ModelRecord("chat", "v1", "gguf", "/", "", 0))


@pytest.fixture
async def stub() -> AsyncIterator[registry_pb2_grpc.RegistryStub]:
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(_registry(), ApiKeys(["admin-k"])), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield registry_pb2_grpc.RegistryStub(channel)
    await server.stop(None)


ADMIN = (("authorization", "Bearer admin-k"),)


async def test_alias_writes_need_the_admin_key(stub: registry_pb2_grpc.RegistryStub) -> None:
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SetAlias(_request("smollm2", ("v1", 1)), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (info.value.details() or "").startswith("admin key: ")
    listing = await stub.ListModels(pb.ListModelsRegistryRequest())
    assert list(listing.aliases) == []  # nothing was written


def _request(name: str, *targets: tuple[str, int], model: str = "") -> pb.SetAliasRequest:
    return pb.SetAliasRequest(
        alias=pb.Alias(
            name=name,
            model=model,
            targets=[pb.AliasTarget(version=v, weight=w) for v, w in targets],
        )
    )


async def test_set_alias_over_grpc_lists_it(stub: registry_pb2_grpc.RegistryStub) -> None:
    stored = await stub.SetAlias(_request("smollm2", ("v1", 90), ("v2", 10)), metadata=ADMIN)
    assert stored.model == "smollm2"  # an empty model means the alias's own name
    listing = await stub.ListModels(pb.ListModelsRegistryRequest())
    assert [(a.name, [(t.version, t.weight) for t in a.targets]) for a in listing.aliases] == [
        ("smollm2", [("v1", 90), ("v2", 10)])
    ]


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (_request("smollm2", ("v1", 0)), grpc.StatusCode.INVALID_ARGUMENT, "weight=0"),
        (_request("smollm2"), grpc.StatusCode.INVALID_ARGUMENT, "at least one version"),
        (_request("smollm2", ("v3", 1)), grpc.StatusCode.NOT_FOUND, "version='v3'"),
        (_request("x", ("v1", 1), model="nope"), grpc.StatusCode.NOT_FOUND, "model='nope'"),
    ],
)
async def test_bad_aliases_get_status_codes(
    stub: registry_pb2_grpc.RegistryStub,
    request_: pb.SetAliasRequest,
    code: grpc.StatusCode,
    message: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SetAlias(request_, metadata=ADMIN)
    assert info.value.code() == code
    assert message in (info.value.details() or "")


async def test_deleting_a_missing_alias_is_not_found(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.DeleteAlias(pb.DeleteAliasRequest(name="smollm2"), metadata=ADMIN)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "alias 'smollm2' does not exist (known: none)"
