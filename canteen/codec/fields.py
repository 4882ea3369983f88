"""Copies the fields a domain dataclass and a protobuf message share by name.

Scalars, repeated scalars (tuples on the domain side) and maps of scalars (dicts) travel by
name with no code per field. A shared field that holds messages (a nested message, or a
repeated field of them) must be given by the caller, explicitly: leaving one out is an error
rather than a field silently dropped. So a scalar field added with the same name to both
sides travels without a change here or in any codec module.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

M = TypeVar("M", bound=Message)
D = TypeVar("D", bound="DataclassInstance")


def _kind(field: FieldDescriptor) -> str:
    """``scalar``, ``repeated`` (of scalars), ``map`` (of scalars) or ``message``."""
    entry = field.message_type
    if entry is None:
        return "repeated" if field.is_repeated else "scalar"
    if entry.GetOptions().map_entry and entry.fields_by_name["value"].message_type is None:
        return "map"
    return "message"


@cache
def shared(cls: type, descriptor: Any) -> tuple[tuple[str, str], ...]:
    """(name, kind) of every field that ``cls`` and the message both have; ``descriptor``
    is a message type's DESCRIPTOR (upb or pure Python)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return tuple((f.name, _kind(f)) for f in descriptor.fields if f.name in names)


@cache
def _copied(cls: type, descriptor: Any, given: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """(name, how to make the domain value) of the shared fields to copy: those not
    ``given`` explicitly, which must hold every message-valued one. Cached: it runs for
    every message of every step."""
    pairs = shared(cls, descriptor)
    missing = [name for name, kind in pairs if kind == "message" and name not in given]
    if missing:
        raise TypeError(
            f"{cls.__name__} <-> {descriptor.name}: field {missing[0]!r} holds messages "
            "and must be converted explicitly"
        )
    convert = {"repeated": tuple, "map": dict, "scalar": None}
    return tuple((name, convert[kind]) for name, kind in pairs if name not in given)


def to_pb(value: DataclassInstance, message: type[M], **explicit: Any) -> M:
    """``message`` with every shared field copied from ``value``; ``explicit`` gives the
    fields that differ (nested messages, other names) and overrides a shared one."""
    for name, _ in _copied(type(value), message.DESCRIPTOR, tuple(explicit)):
        explicit[name] = getattr(value, name)
    return message(**explicit)


def from_pb(msg: Message, cls: type[D], **explicit: Any) -> D:
    """``cls`` built from the shared fields of ``msg`` (repeated fields as tuples, maps as
    dicts) and ``explicit``; a field of ``cls`` in neither takes its default."""
    for name, convert in _copied(cls, msg.DESCRIPTOR, tuple(explicit)):
        raw = getattr(msg, name)
        explicit[name] = raw if convert is None else convert(raw)
    return cls(**explicit)
