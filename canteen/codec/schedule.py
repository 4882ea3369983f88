"""The scheduler contract (``Scheduler/Generate``): ``ScheduleRequest`` <-> ``Request``, and
the scheduler's sequence events -> ``ScheduleResponse``.

Fields travel by name (canteen/codec/fields.py); only what differs is written here: the
nested sampling, usage and top logprobs, the finish reason, the deadline (from the call's
own timeout, not a field) and the queue time (sent once, on a stream's first message).
"""

from __future__ import annotations

import time
from dataclasses import Field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from canteen.codec.adapter import adapter_from_pb, adapter_to_pb
from canteen.codec.fields import from_pb, to_pb
from canteen.codec.sampling import sampling_from_pb, sampling_to_pb
from canteen.codec.step import top_to_pb
from canteen.finish import Finish, finish_to_pb
from canteen.request import Request
from canteen.v1 import common_pb2, scheduler_pb2

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class Event(Protocol):
    """What the codec reads of a scheduler event (``scheduler.sequence.SeqEvent``, a
    dataclass; canteen/ does not import scheduler/). Its token ids and logprobs travel by
    name."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def finish(self) -> Finish | None: ...
    @property
    def top_logprobs(self) -> tuple[tuple[tuple[int, float], ...], ...]: ...
    @property
    def usage(self) -> DataclassInstance: ...
    @property
    def queue_seconds(self) -> float | None: ...


def request_to_pb(request: Request) -> scheduler_pb2.ScheduleRequest:
    return to_pb(
        request,
        scheduler_pb2.ScheduleRequest,
        sampling=sampling_to_pb(request.sampling),
        adapter=adapter_to_pb(request.adapter),
    )


def request_from_pb(
    msg: scheduler_pb2.ScheduleRequest, time_remaining: float | None = None
) -> Request:
    """``time_remaining``: the call's timeout left, in seconds (None: no deadline)."""
    return from_pb(
        msg,
        Request,
        sampling=sampling_from_pb(msg.sampling),
        adapter=adapter_from_pb(msg.adapter),
        deadline=None if time_remaining is None else time.monotonic() + time_remaining,
    )


def response_to_pb(
    event: Event, is_first: bool, stream_tag: int = 0
) -> scheduler_pb2.ScheduleResponse:
    """One stream message; the queue time only on the stream's first, the finish reason and
    usage only on its last."""
    queue_seconds = event.queue_seconds if is_first else None
    is_last = event.finish is not None
    return to_pb(
        event,
        scheduler_pb2.ScheduleResponse,
        top_logprobs=[top_to_pb(top) for top in event.top_logprobs],
        queue_seconds=queue_seconds or 0.0,  # 0: not sent
        finish_reason=finish_to_pb(event.finish),
        usage=to_pb(event.usage, common_pb2.Usage) if is_last else None,
        stream_tag=stream_tag,
    )
