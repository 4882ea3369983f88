"""registry/codec.py: the registry's records, aliases and worker entries survive a trip
through their protobuf and the wire, travel by field name, and encode to the same bytes as
the hand-written converters they replaced."""

from __future__ import annotations

from dataclasses import fields

import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from canteen.v1 import registry_pb2 as pb
from registry.aliases import Alias, AliasTarget
from registry.codec import (
    alias_from_pb,
    alias_to_pb,
    entry_from_pb,
    entry_to_pb,
    record_from_pb,
    record_to_pb,
)
from registry.directory import WorkerEntry
from registry.store import ModelRecord

TEXT = st.text(max_size=8)
INT32 = st.integers(0, 2**31 - 1)
RECORD = st.builds(
    ModelRecord, TEXT, TEXT, st.sampled_from(["safetensors", "gguf"]), TEXT, TEXT, INT32
)
ALIAS = st.builds(
    Alias,
    TEXT.filter(bool),
    TEXT.filter(bool),
    st.lists(st.builds(AliasTarget, TEXT, INT32), max_size=3).map(tuple),
)
ENTRY = st.builds(WorkerEntry, TEXT, TEXT, TEXT, TEXT)


@settings(max_examples=100)
@given(RECORD)
def test_a_model_record_round_trips(record: ModelRecord) -> None:
    wire = record_to_pb(record).SerializeToString()
    assert record_from_pb(pb.ModelRecord.FromString(wire)) == record


def test_a_client_cannot_set_the_creation_time_or_an_unknown_format() -> None:
    msg = pb.ModelRecord(name="m", version="v", format=pb.MODEL_FORMAT_GGUF, created_unix=5)
    assert record_from_pb(msg) == ModelRecord("m", "v", "gguf", "", "", 0, 0)
    unknown = pb.ModelRecord(name="m", format=99)  # type: ignore[arg-type]
    assert record_from_pb(unknown).format == ""


@settings(max_examples=100)
@given(ALIAS)
def test_an_alias_round_trips(alias: Alias) -> None:
    wire = alias_to_pb(alias).SerializeToString()
    assert alias_from_pb(pb.Alias.FromString(wire)) == alias


def test_an_alias_without_a_model_names_its_own() -> None:
    msg = pb.Alias(name="smol", targets=[pb.AliasTarget(version="v1", weight=1)])
    assert alias_from_pb(msg) == Alias("smol", "smol", (AliasTarget("v1", 1),))


@settings(max_examples=100)
@given(ENTRY)
def test_a_worker_entry_round_trips(entry: WorkerEntry) -> None:
    msg = entry_to_pb(entry)
    assert (msg.worker_id, msg.address, msg.model, msg.version) == (
        entry.worker_id,
        entry.address,
        entry.model,
        entry.version,
    )
    request = pb.RegisterWorkerRequest(
        worker_id=entry.worker_id, address=entry.address, model=entry.model, version=entry.version
    )
    assert entry_from_pb(pb.RegisterWorkerRequest.FromString(request.SerializeToString())) == entry


def test_the_wire_bytes_of_fixed_examples_are_unchanged() -> None:
    """Hex of what the hand-written converters in registry/server.py encoded."""
    record = ModelRecord("smol", "v2", "gguf", "/m/smol.gguf", "ab" * 32, 2048, 1700000000)
    assert record_to_pb(record).SerializeToString().hex() == (
        "0a04736d6f6c120276321802220c2f6d2f736d6f6c2e676775662a40"
        + "6162" * 32
        + "3080103880e2cfaa06"
    )
    alias = Alias("chat", "smol", (AliasTarget("v1", 90), AliasTarget("v2", 10)))
    assert alias_to_pb(alias).SerializeToString().hex() == (
        "0a04636861741204736d6f6c1a060a027631105a1a060a027632100a"
    )
    entry = WorkerEntry("w1", "127.0.0.1:5", "smol", "v2")
    assert entry_to_pb(entry).SerializeToString().hex() == (
        "0a027731120b3132372e302e302e313a351a04736d6f6c22027632"
    )


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (ModelRecord, pb.ModelRecord),
        (Alias, pb.Alias),
        (AliasTarget, pb.AliasTarget),
        (WorkerEntry, pb.WorkerEntry),
        (WorkerEntry, pb.RegisterWorkerRequest),
    ],
)
def test_every_field_is_on_both_sides(cls: type, message: type[Message]) -> None:
    """A field added to one side and not the other fails here, not silently on the wire."""
    assert {f.name for f in fields(cls)} == set(message.DESCRIPTOR.fields_by_name)
