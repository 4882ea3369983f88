"""Why a generation ended: the one enum every service uses, and its two translations.

The scheduler sets STOP, LENGTH, CANCELLED or FAILED; the gateway adds CONTENT_FILTER (the
screen cut the answer) and TOOL_CALLS (the answer ended with function calls). FAILED never
travels: a failed sequence ends its call with an error status instead.

``finish_to_pb``/``finish_from_pb`` are the only mapping to ``common_pb2.FinishReason``,
``openai_finish`` the only one to OpenAI's public ``finish_reason`` strings.
"""

from __future__ import annotations

import enum

from canteen.v1 import common_pb2


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    FAILED = "failed"
    CONTENT_FILTER = "content_filter"
    TOOL_CALLS = "tool_calls"


_TO_PB: dict[Finish, common_pb2.FinishReason.ValueType] = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    Finish.CONTENT_FILTER: common_pb2.FINISH_REASON_CONTENT_FILTER,
    Finish.TOOL_CALLS: common_pb2.FINISH_REASON_TOOL_CALLS,
}
_FROM_PB: dict[int, Finish] = {pb: finish for finish, pb in _TO_PB.items()}


def finish_to_pb(finish: Finish | None) -> common_pb2.FinishReason.ValueType:
    """The protobuf value; UNSPECIFIED for a stream that has not finished. FAILED has none
    (KeyError): it is an error status on the wire, never a finish reason."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if finish is None else _TO_PB[finish]


def finish_from_pb(value: int) -> Finish | None:
    """The enum for a protobuf value; None for UNSPECIFIED (not finished) or a value this
    build does not know."""
    return _FROM_PB.get(value)


def openai_finish(finish: Finish | None) -> str | None:
    """OpenAI's ``finish_reason``: a cancelled request reads as "stop" (OpenAI has no
    cancelled); None while the choice goes on."""
    if finish is None:
        return None
    return Finish.STOP.value if finish is Finish.CANCELLED else finish.value
