"""The gateway's model catalog: exact pins, latest versions, and weighted aliases (canaries)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from canteen.v1 import registry_pb2 as pb
from gateway.catalog import ModelCatalog, UnknownModelError


def snapshot(*aliases: pb.Alias, default: str = "smollm2") -> pb.ListModelsRegistryResponse:
    models = [
        pb.ModelRecord(
            name=name,
            version=version,
            format=pb.MODEL_FORMAT_GGUF,
            path=f"/{name}-{version}.gguf",
            max_model_len=2048,
        )
        for name, version in (("smollm2", "v1"), ("smollm2", "v2"), ("tiny", "v1"))
    ]
    return pb.ListModelsRegistryResponse(models=models, default_model=default, aliases=aliases)


def canary(name: str, *targets: tuple[str, int], model: str = "smollm2") -> pb.Alias:
    return pb.Alias(
        name=name,
        model=model,
        targets=[pb.AliasTarget(version=v, weight=w) for v, w in targets],
    )


def catalog(*aliases: pb.Alias, seed: int = 0) -> ModelCatalog:
    c = ModelCatalog("unused:0", rng=random.Random(seed))
    c.apply(snapshot(*aliases))
    return c


def test_without_an_alias_a_name_is_its_latest_version() -> None:
    c = catalog()
    assert c.resolve("smollm2").ref == "smollm2:v2"
    assert c.resolve("").ref == "smollm2:v2"  # the default model
    assert c.resolve("smollm2:v1").ref == "smollm2:v1"


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_a_90_10_canary_splits_1000_resolutions(seed: int) -> None:
    c = catalog(canary("smollm2", ("v1", 90), ("v2", 10)), seed=seed)
    counts = Counter(c.resolve("smollm2").ref for _ in range(1000))
    assert set(counts) == {"smollm2:v1", "smollm2:v2"}
    assert 850 <= counts["smollm2:v1"] <= 950
    assert 50 <= counts["smollm2:v2"] <= 150


def test_a_seeded_rng_repeats_its_draws() -> None:
    draws = [
        [c.resolve("smollm2").version for _ in range(200)]
        for c in (catalog(canary("smollm2", ("v1", 1), ("v2", 1)), seed=7) for _ in range(2))
    ]
    assert draws[0] == draws[1]


def test_an_alias_leaves_pins_and_other_models_alone() -> None:
    c = catalog(canary("smollm2", ("v1", 100)))
    assert {c.resolve("smollm2").ref for _ in range(50)} == {"smollm2:v1"}
    assert c.resolve("smollm2:v2").ref == "smollm2:v2"
    assert c.resolve("tiny").ref == "tiny:v1"
    assert c.resolve("").ref == "smollm2:v1"  # the default model's name goes through its alias


def test_an_alias_with_its_own_name_serves_the_exact_version() -> None:
    c = catalog(canary("chat", ("v2", 3)))
    model = c.resolve("chat")
    assert (model.ref, model.path) == ("smollm2:v2", "/smollm2-v2.gguf")
    assert [r.name for r in c.aliases()] == ["chat"]


def test_a_new_snapshot_replaces_the_alias_table() -> None:
    c = catalog(canary("smollm2", ("v1", 100)))
    c.apply(snapshot())
    assert c.resolve("smollm2").ref == "smollm2:v2"
    assert c.aliases() == []


def test_targets_the_snapshot_lacks_are_left_out() -> None:
    c = catalog(canary("smollm2", ("v1", 1), ("gone", 99)))
    assert {c.resolve("smollm2").ref for _ in range(50)} == {"smollm2:v1"}


def test_unknown_names_list_models_and_aliases() -> None:
    c = catalog(canary("chat", ("v1", 1)))
    with pytest.raises(UnknownModelError, match=r"'nope' is not registered \(available: chat, "):
        c.resolve("nope")
    with pytest.raises(UnknownModelError, match="'smollm2:v9'"):
        c.resolve("smollm2:v9")
