"""The registry's protobuf <-> domain conversions, by field name (canteen/codec/fields.py).

They stay here, beside the types they convert (registry/store.py's ``ModelRecord``,
registry/aliases.py's ``Alias``, registry/directory.py's ``WorkerEntry``): only the registry
converts those types, and canteen/ does not import registry/. Only what differs is written:
the model format (a string here, an enum on the wire), nested alias targets, and an alias's
empty model (its own name).
"""

from __future__ import annotations

from canteen.codec.fields import from_pb, to_pb
from canteen.v1 import registry_pb2 as pb
from registry.aliases import Alias, AliasTarget
from registry.directory import WorkerEntry
from registry.store import ModelRecord

_FORMATS = {
    "safetensors": pb.MODEL_FORMAT_SAFETENSORS,
    "gguf": pb.MODEL_FORMAT_GGUF,
    "peft_lora": pb.MODEL_FORMAT_PEFT_LORA,
}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}


def record_to_pb(record: ModelRecord) -> pb.ModelRecord:
    return to_pb(record, pb.ModelRecord, format=_FORMATS[record.format])


def record_from_pb(msg: pb.ModelRecord) -> ModelRecord:
    """A record to add: an unknown format is the empty string (refused by the registry's
    checks, by name), and the registry stamps the creation time itself."""
    return from_pb(msg, ModelRecord, format=_FORMAT_NAMES.get(msg.format, ""), created_unix=0)


def alias_to_pb(alias: Alias) -> pb.Alias:
    return to_pb(alias, pb.Alias, targets=[to_pb(t, pb.AliasTarget) for t in alias.targets])


def alias_from_pb(msg: pb.Alias) -> Alias:
    """An empty model means the alias's own name."""
    return from_pb(
        msg,
        Alias,
        model=msg.model or msg.name,
        targets=tuple(from_pb(t, AliasTarget) for t in msg.targets),
    )


def entry_to_pb(entry: WorkerEntry) -> pb.WorkerEntry:
    return to_pb(entry, pb.WorkerEntry)


def entry_from_pb(msg: pb.RegisterWorkerRequest) -> WorkerEntry:
    return from_pb(msg, WorkerEntry)
