"""LoRA adapters at the gateway: an adapter resolves like any model (latest version, pinned,
or through an alias), runs on its base model's workers with the adapter on the request, and
reads prompts with its base's tokenizer."""

from __future__ import annotations

import random
from collections import Counter

from canteen.adapters import AdapterRef
from canteen.codec import request_from_pb
from canteen.plan import Sampling
from canteen.v1 import registry_pb2 as pb
from gateway.admission import Admitted
from gateway.catalog import ModelCatalog, ModelVersion
from gateway.limits import RateLimiter
from gateway.service import schedule_request
from gateway.validate import GenerateInput

BASE = "SmolLM2-135M-Instruct"


def _record(name: str, version: str, base: str = "") -> pb.ModelRecord:
    return pb.ModelRecord(
        name=name,
        version=version,
        format=pb.MODEL_FORMAT_PEFT_LORA if base else pb.MODEL_FORMAT_GGUF,
        path=f"/models/{name}-{version}",
        sha256=f"{name}-{version}-digest",
        max_model_len=2048,
        base=base,
    )


def catalog(*aliases: pb.Alias) -> ModelCatalog:
    c = ModelCatalog("unused:0", rng=random.Random(0))
    models = [
        _record("poet", "v1", base=f"{BASE}:q4_1"),  # listed before its base: by name
        _record(BASE, "q4_1"),
        _record("sql-writer", "v1", base=f"{BASE}:q4_1"),
        _record("sql-writer", "v2", base=f"{BASE}:q4_1"),
        _record("orphan", "v1", base="gone:v1"),
    ]
    c.apply(pb.ListModelsRegistryResponse(models=models, default_model=BASE, aliases=aliases))
    return c


def test_an_adapter_resolves_by_name_or_pinned_and_runs_on_its_base() -> None:
    c = catalog()
    latest, pinned = c.resolve("sql-writer"), c.resolve("sql-writer:v1")
    assert (latest.ref, pinned.ref) == ("sql-writer:v2", "sql-writer:v1")
    assert latest.served.ref == f"{BASE}:q4_1"
    assert latest.served.path == f"/models/{BASE}-q4_1"
    assert latest.adapter == AdapterRef(
        "sql-writer", "v2", "/models/sql-writer-v2", "sql-writer-v2-digest"
    )
    assert c.resolve(BASE).adapter is None and c.resolve(BASE).served.ref == f"{BASE}:q4_1"
    assert c.resolve("poet").served.ref == f"{BASE}:q4_1"


def test_an_adapter_whose_base_is_not_listed_is_left_out() -> None:
    c = catalog()
    assert [m.name for m in c.models()] == [BASE, "poet", "sql-writer"]
    assert [m.base.name if m.base else None for m in c.models()] == [None, BASE, BASE]


def test_an_alias_splits_across_adapter_versions() -> None:
    split = pb.Alias(
        name="sql-writer",
        model="sql-writer",
        targets=[pb.AliasTarget(version="v1", weight=90), pb.AliasTarget(version="v2", weight=10)],
    )
    c = catalog(split)
    drawn = Counter(c.resolve("sql-writer").version for _ in range(1000))
    assert 850 < drawn["v1"] < 950 and drawn["v1"] + drawn["v2"] == 1000
    assert c.resolve("sql-writer:v2").version == "v2"


def _admitted(model: ModelVersion) -> Admitted:
    inp = GenerateInput("r1", prompt="hi", max_tokens=4, sampling=Sampling())
    reservation = RateLimiter(0, 0).reserve("k", 10)
    return Admitted(inp, model, None, [5, 6], 4, reservation)  # type: ignore[arg-type]


def test_the_scheduler_is_asked_for_the_base_model_with_the_adapter() -> None:
    c = catalog()
    request = request_from_pb(schedule_request(_admitted(c.resolve("sql-writer:v1"))))
    assert (request.model, request.version) == (BASE, "q4_1")
    assert request.adapter == AdapterRef(
        "sql-writer", "v1", "/models/sql-writer-v1", "sql-writer-v1-digest"
    )
    plain = request_from_pb(schedule_request(_admitted(c.resolve(BASE))))
    assert (plain.model, plain.version, plain.adapter) == (BASE, "q4_1", None)
