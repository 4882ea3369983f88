"""Model versions and canary aliases through the real registry process and the ``canteen`` CLI:
the watch stream pushes an alias the moment it is set, and the gateway's catalog, following that
stream, splits 1,000 resolutions by the alias's weights."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import registry_pb2, registry_pb2_grpc
from gateway.catalog import ModelCatalog
from tests.support.suite import Service, Suite, canteen_models


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """An empty registry; the first test adds tiny:v1, tiny:v2 and the alias the rest use."""
    s = Suite(tmp_path_factory.mktemp("aliases"))
    try:
        yield s.start_registry("--no-register-default", "--default-model", "tiny")
    finally:
        s.stop()


def _aliases(msg: registry_pb2.ListModelsRegistryResponse) -> dict[str, list[tuple[str, int]]]:
    return {a.name: [(t.version, t.weight) for t in a.targets] for a in msg.aliases}


def test_the_watch_stream_delivers_an_alias_set_by_the_cli(
    registry: Service, tiny_model_dir: Path
) -> None:
    with grpc.insecure_channel(registry.address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        watch = stub.WatchModels(registry_pb2.WatchModelsRequest(), timeout=120)
        first = next(watch)
        assert list(first.models) == [] and list(first.aliases) == []

        for version in ("v1", "v2"):  # two versions of the same weights
            added = canteen_models(
                registry, "add", str(tiny_model_dir), "--name", "tiny", "--version", version
            )
            assert added.returncode == 0, added.stderr
            assert added.stdout.startswith(f"added tiny:{version} sha256=")
        alias = canteen_models(registry, "alias", "tiny", "--to", "v1=90,v2=10")
        assert alias.returncode == 0, alias.stderr
        assert alias.stdout.strip() == "alias tiny -> tiny:v1=90 (90.0%), tiny:v2=10 (10.0%)"

        # changes may coalesce; the stream must reach the alias without a new call
        msg = next(m for m in watch if m.aliases)
        watch.cancel()
    assert _aliases(msg) == {"tiny": [("v1", 90), ("v2", 10)]}
    assert [f"{m.name}:{m.version}" for m in msg.models] == ["tiny:v1", "tiny:v2"]


def test_models_list_shows_versions_and_weights(registry: Service) -> None:
    listing = canteen_models(registry, "list")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["*", "tiny:v1"], ["*", "tiny:v2"]]
    assert lines[2] == "alias tiny -> tiny:v1=90 (90.0%), tiny:v2=10 (10.0%)"


async def test_the_gateway_catalog_splits_by_the_watched_weights(registry: Service) -> None:
    catalog = ModelCatalog(registry.address, rng=random.Random(3))
    follower = asyncio.create_task(catalog.watch_forever())
    try:
        await asyncio.wait_for(catalog.loaded.wait(), 30)
        counts = Counter(catalog.resolve("tiny").ref for _ in range(1000))
        assert catalog.resolve("tiny:v2").ref == "tiny:v2"
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    assert 850 <= counts["tiny:v1"] <= 950 and 50 <= counts["tiny:v2"] <= 150
    assert counts["tiny:v1"] + counts["tiny:v2"] == 1000


@pytest.mark.parametrize(
    ("args", "returncode", "stderr"),
    [
        (
            ("alias", "tiny", "--to", "v1=50,v9=50"),
            1,
            "error: NOT_FOUND: targets[1].version='v9': model 'tiny' has no such version "
            "(known: v1, v2)",
        ),
        (
            ("alias", "tiny", "--to", "v1=50,v1=50"),
            1,
            "error: INVALID_ARGUMENT: targets[1].version='v1': listed more than once",
        ),
        (("alias", "tiny", "--to", "v1=0"), 2, "'v1=0': weight=0 must be in 1..10000"),
        (("alias", "tiny", "--to", "v1"), 2, "'v1': use VERSION=WEIGHT"),
        (("alias", "nope", "--delete"), 1, "error: NOT_FOUND: alias 'nope' does not exist"),
    ],
)
def test_bad_aliases_are_refused_with_the_field_and_the_limit(
    registry: Service, args: tuple[str, ...], returncode: int, stderr: str
) -> None:
    result = canteen_models(registry, *args)
    assert result.returncode == returncode
    assert stderr in result.stderr
