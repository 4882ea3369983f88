"""``AdapterRef`` <-> ``canteen.adapters.AdapterRef``: a nested message, so the contracts
that carry one (``NewSequence``, ``ScheduleRequest``) name it explicitly."""

from __future__ import annotations

from canteen.adapters import AdapterRef
from canteen.codec.fields import from_pb, to_pb
from canteen.v1 import common_pb2


def adapter_to_pb(adapter: AdapterRef | None) -> common_pb2.AdapterRef | None:
    return None if adapter is None else to_pb(adapter, common_pb2.AdapterRef)


def adapter_from_pb(msg: common_pb2.AdapterRef) -> AdapterRef | None:
    """None for an unset field (the base model)."""
    return from_pb(msg, AdapterRef) if msg.name else None
