"""Sampling parameters: ``SamplingParams`` and ``GenerateRequest`` <-> ``canteen.plan.Sampling``.

Fields travel by name (canteen/codec/fields.py): every field of ``Sampling`` is read from, and
written to, the protobuf field of the same name. Adding a sampling parameter therefore means
the proto, the domain type (with its bounds in ``Sampling.problem``) and the code that uses
it; the gateway, the scheduler and the worker all convert through here.
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

from canteen.codec.fields import from_pb, to_pb
from canteen.plan import Constraint, Sampling
from canteen.v1 import common_pb2, inference_pb2

_PLAIN = tuple(f.name for f in fields(Sampling) if f.name != "constraint")
_DEFAULTS = Sampling()


def constraint_to_pb(constraint: Constraint) -> common_pb2.Constraint:
    msg = common_pb2.Constraint()
    if constraint.kind == "json_object":
        msg.json_object = True
    elif constraint.kind == "choice":
        msg.choice.options.extend(constraint.choices)
    else:
        setattr(msg, constraint.kind, constraint.text)
    msg.grammar_text = constraint.converted
    return msg


def constraint_from_pb(msg: common_pb2.Constraint, is_public: bool = False) -> Constraint | None:
    """``is_public``: from a client, whose ``grammar_text`` is never taken (the gateway
    converts the constraint itself, so what the worker compiles is what the client asked)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    converted = "" if is_public else msg.grammar_text
    if kind == "json_object":
        return Constraint("json_object", converted=converted)
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.options), converted=converted)
    return Constraint(kind, text=getattr(msg, kind), converted=converted)


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    constraint = sampling.constraint
    return to_pb(
        sampling,
        common_pb2.SamplingParams,
        constraint=None if constraint is None else constraint_to_pb(constraint),
    )


def sampling_from_pb(msg: common_pb2.SamplingParams) -> Sampling:
    """Between services: every field is set by the sender, so values are taken as they are."""
    constraint = constraint_from_pb(msg.constraint) if msg.HasField("constraint") else None
    return from_pb(msg, Sampling, constraint=constraint)


def sampling_from_request(msg: inference_pb2.GenerateRequest) -> Sampling:
    """From a public request (``GenerateRequest``): a field the client left unset takes the
    domain default, and an unset seed a random one (so a resumed stream keeps its seed)."""
    kwargs: dict[str, Any] = {}
    present = {field.name for field, _ in msg.ListFields()}
    for name in _PLAIN:
        field = msg.DESCRIPTOR.fields_by_name.get(name)
        if field is None or (field.has_presence and name not in present):
            kwargs[name] = getattr(_DEFAULTS, name)
        else:
            kwargs[name] = getattr(msg, name)
    if not msg.HasField("seed"):
        kwargs["seed"] = random_seed()
    constraint = None
    if msg.HasField("constraint"):
        constraint = constraint_from_pb(msg.constraint, is_public=True)
    return Sampling(**kwargs, constraint=constraint)


def random_seed() -> int:
    return random.getrandbits(63)
