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


def _plain(cls: type, descriptor: Any, explicit: dict[str, Any]) -> list[tuple[str, str]]:
    """The shared fields to copy: those not in ``explicit``, which must hold every message."""
    pairs = shared(cls, descriptor)
    missing = [name for name, kind in pairs if kind == "message" and name not in explicit]
    if missing:
        raise TypeError(
            f"{cls.__name__} <-> {descriptor.name}: field {missing[0]!r} holds messages "
            "and must be converted explicitly"
        )
    return [(name, kind) for name, kind in pairs if name not in explicit]


def to_pb(value: DataclassInstance, message: type[M], **explicit: Any) -> M:
    """``message`` with every shared field copied from ``value``; ``explicit`` gives the
    fields that differ (nested messages, other names) and overrides a shared one."""
    copied = _plain(type(value), message.DESCRIPTOR, explicit)
    return message(**{name: getattr(value, name) for name, _ in copied}, **explicit)


def from_pb(msg: Message, cls: type[D], **explicit: Any) -> D:
    """``cls`` built from the shared fields of ``msg`` (repeated fields as tuples, maps as
    dicts) and ``explicit``; a field of ``cls`` in neither takes its default."""
    kwargs: dict[str, Any] = {}
    for name, kind in _plain(cls, msg.DESCRIPTOR, explicit):
        raw = getattr(msg, name)
        kwargs[name] = tuple(raw) if kind == "repeated" else dict(raw) if kind == "map" else raw
    return cls(**kwargs, **explicit)
