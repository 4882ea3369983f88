"""Copies the fields a domain dataclass and a protobuf message share by name.

Scalars, repeated scalars (tuples on the domain side) and maps of scalars (dicts) travel by
name with no code per field. A shared field that holds messages (a nested message, or a
repeated field of them) must be given by the caller, explicitly: leaving one out is an error
rather than a field silently dropped. So a scalar field added with the same name to both
sides travels without a change here or in any codec module.

Speed: for each (dataclass, message, explicit names) the copy is compiled once, from the
descriptors, into one small function that reads each field as an attribute and builds the
result in one keyword call, as a hand-written converter would. The hot paths (one call per
sequence of every step) hold such a function (``encoder``/``decoder``); ``to_pb`` and
``from_pb`` look it up per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar, cast

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


def _copied(cls: type, descriptor: Any, given: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(name, kind) of the shared fields to copy: those not ``given`` explicitly, which must
    hold every message-valued one."""
    pairs = shared(cls, descriptor)
    missing = [name for name, kind in pairs if kind == "message" and name not in given]
    if missing:
        raise TypeError(
            f"{cls.__name__} <-> {descriptor.name}: field {missing[0]!r} holds messages "
            "and must be converted explicitly"
        )
    return tuple((name, kind) for name, kind in pairs if name not in given)


_RESERVED = frozenset({"source", "sources", "target", "tuple", "dict", "list"})  # the code's own
_WRAP = {"repeated": "tuple(source.{})", "map": "dict(source.{})", "scalar": "source.{}"}


def _arguments(target: type, values: dict[str, str]) -> str:
    """The call's arguments: a dataclass takes its leading fields positionally (a little
    faster), up to the first one it is not given; the rest, and a message's, by keyword."""
    order = [f.name for f in dataclasses.fields(target)] if dataclasses.is_dataclass(target) else []
    positional = []
    for name in order:
        if name not in values:
            break
        positional.append(values.pop(name))
    return ", ".join([*positional, *(f"{name}={expr}" for name, expr in values.items())])


def _compile(
    target: type,
    copied: dict[str, str],
    given: tuple[str, ...],
    each: dict[str, Callable[[Any], Any]],
    many: str,
) -> Callable[..., Any]:
    """``def convert(source, *, <given>): return target(<copied>, <given>=<given>)``; an
    ``each`` field is ``fn(source)``. ``many`` (``list``/``tuple``) compiles instead
    ``def convert(sources): return many([target(...) for source in sources])``, and
    ``into`` ``def convert(target, source, *, <given>)``: the caller names the target (a
    repeated field's ``add``). Every name comes from a descriptor or a dataclass field, so
    is a Python identifier."""
    names = (*given, *each, *copied)
    if not all(name.isidentifier() and name not in _RESERVED for name in names):
        raise ValueError(f"{target.__name__}: a field name cannot be compiled: {names}")
    values = {**copied, **{n: n for n in given}, **{n: f"_{n}(source)" for n in each}}
    call = f"target({_arguments(target, values)})"
    star = ", *, " + ", ".join(given) if given else ""
    if many == "into":
        code = f"def convert(target, source{star}):\n    return {call}\n"
    elif many:
        listed = f"[{call} for source in sources]"
        body = listed if many == "list" else f"tuple({listed})"
        code = f"def convert(sources):\n    return {body}\n"
    else:
        code = f"def convert(source{star}):\n    return {call}\n"
    scope: dict[str, Any] = {"target": target, "tuple": tuple, "dict": dict, "list": list}
    scope.update({f"_{name}": fn for name, fn in each.items()})
    exec(compile(code, f"<codec {target.__name__}>", "exec"), scope)
    convert: Callable[..., Any] = scope["convert"]
    return convert


def _reads(pairs: tuple[tuple[str, str], ...], to_domain: bool) -> dict[str, str]:
    """name -> how the compiled code reads it from ``source``."""
    if to_domain:
        return {name: _WRAP[kind].format(name) for name, kind in pairs}
    return {name: f"source.{name}" for name, _ in pairs}


@cache
def _encoder(cls: type, message: Any, given: tuple[str, ...]) -> Callable[..., Any]:
    pairs = _copied(cls, message.DESCRIPTOR, given)
    return _compile(message, _reads(pairs, False), given, {}, "")


@cache
def _decoder(message: Any, cls: type, given: tuple[str, ...]) -> Callable[..., Any]:
    pairs = _copied(cls, message.DESCRIPTOR, given)
    return _compile(cls, _reads(pairs, True), given, {}, "")


def encoder(cls: type[D], message: type[M], *given: str) -> Callable[..., M]:
    """A function ``(value, **given) -> message`` that copies every shared field of a
    ``cls`` value; the ``given`` fields (message-valued ones, other names) are its keyword
    arguments. Compiled once per (cls, message, given)."""
    convert: Callable[..., M] = _encoder(cls, cast(Any, message), given)
    return convert


def adder(cls: type[D], message: type[M], *given: str) -> Callable[..., M]:
    """As ``encoder``, into a target the caller passes first: ``(add, value, **given)``
    with ``add`` a repeated field's ``add`` (the message is built in place, not built and
    then copied into its parent) or ``message`` itself. Compiled once per call of this."""
    pairs = _copied(cls, cast(Any, message).DESCRIPTOR, given)
    convert: Callable[..., M] = _compile(message, _reads(pairs, False), given, {}, "into")
    return convert


def list_encoder(
    cls: type[D], message: type[M], **each: Callable[[D], Any]
) -> Callable[[Iterable[D]], list[M]]:
    """A function ``(values) -> [message, ...]``, one call for a whole repeated field;
    ``each`` gives a field as a function of the value (nested messages, other names)."""
    pairs = _copied(cls, message.DESCRIPTOR, tuple(each))
    return _compile(message, _reads(pairs, False), (), each, "list")


def decoder(message: type[M], cls: type[D], *given: str) -> Callable[..., D]:
    """A function ``(msg, **given) -> cls`` that copies every shared field of a ``message``
    (repeated fields as tuples, maps as dicts); a field of ``cls`` in neither takes its
    default. Compiled once per (message, cls, given)."""
    convert: Callable[..., D] = _decoder(cast(Any, message), cls, given)
    return convert


def tuple_decoder(
    message: type[M], cls: type[D], **each: Callable[[M], Any]
) -> Callable[[Iterable[M]], tuple[D, ...]]:
    """A function ``(msgs) -> (cls, ...)``, one call for a whole repeated field; ``each``
    gives a field as a function of the message."""
    pairs = _copied(cls, message.DESCRIPTOR, tuple(each))
    return _compile(cls, _reads(pairs, True), (), each, "tuple")


def to_pb(value: DataclassInstance, message: type[M], **explicit: Any) -> M:
    """``message`` with every shared field copied from ``value``; ``explicit`` gives the
    fields that differ (nested messages, other names) and overrides a shared one."""
    msg: M = _encoder(type(value), cast(Any, message), tuple(explicit))(value, **explicit)
    return msg


def from_pb(msg: Message, cls: type[D], **explicit: Any) -> D:
    """``cls`` built from the shared fields of ``msg`` (repeated fields as tuples, maps as
    dicts) and ``explicit``; a field of ``cls`` in neither takes its default."""
    value: D = _decoder(cast(Any, type(msg)), cls, tuple(explicit))(msg, **explicit)
    return value
