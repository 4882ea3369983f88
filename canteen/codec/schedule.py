"""The scheduler contract (``Scheduler/Generate``): ``ScheduleRequest`` <-> ``Request``, and
the scheduler's sequence events -> ``ScheduleResponse``.

Fields travel by name (canteen/codec/fields.py); only what differs is written here: the
nested sampling, usage and top logprobs, the finish reason, the deadline (from the call's
own timeout, not a field) and the queue time (sent once, on a stream's first message).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import Field
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from canteen.codec.adapter import adapter_from_pb, adapter_to_pb
from canteen.codec.fields import adder, from_pb, to_pb
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
    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def logprobs(self) -> tuple[float, ...]: ...


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


@cache
def _response_adder(cls: type[DataclassInstance]) -> Callable[..., scheduler_pb2.ScheduleResponse]:
    """Builds a response in place (a batch's ``responses.add``) or alone (the message
    class): the fields shared with the event ``cls`` by name, the rest given."""
    return adder(
        cls,
        scheduler_pb2.ScheduleResponse,
        "top_logprobs",
        "queue_seconds",
        "finish_reason",
        "usage",
        "stream_tag",
    )


def _add_response(
    add: Callable[..., scheduler_pb2.ScheduleResponse], event: Event, is_first: bool, tag: int
) -> scheduler_pb2.ScheduleResponse:
    """One stream message; the queue time only on the stream's first, the finish reason and
    usage only on its last. Runs once per request per step: a message built with nothing
    it does not carry."""
    finish = event.finish
    tops = event.top_logprobs
    return _response_adder(type(event))(
        add,
        event,
        top_logprobs=[top_to_pb(top) for top in tops] if tops else (),
        queue_seconds=(event.queue_seconds or 0.0) if is_first else 0.0,  # 0: not sent
        finish_reason=0 if finish is None else finish_to_pb(finish),
        usage=None if finish is None else to_pb(event.usage, common_pb2.Usage),
        stream_tag=tag,
    )


def response_to_pb(
    event: Event, is_first: bool, stream_tag: int = 0
) -> scheduler_pb2.ScheduleResponse:
    """One request's own stream message (see ``_add_response``)."""
    return _add_response(scheduler_pb2.ScheduleResponse, event, is_first, stream_tag)


def batch_to_pb(
    entries: Iterable[tuple[int, Event, bool]], packed: bool = False
) -> scheduler_pb2.ScheduleBatch:
    """One shared-stream message: a response per (tag, event, whether it is the request's
    first entry), each built in place in the batch. ``packed`` (a Connect stream): the
    entries that carry tokens and logprobs only go in the batch's parallel arrays instead,
    four repeated fields filled at once rather than a message per request."""
    batch = scheduler_pb2.ScheduleBatch()
    add = batch.responses.add
    if not packed:
        for tag, event, is_first in entries:
            _add_response(add, event, is_first, tag)
        return batch
    tags: list[int] = []
    counts: list[int] = []
    ids: list[int] = []
    logprobs: list[float] = []
    for tag, event, is_first in entries:
        tokens, probs = event.token_ids, event.logprobs
        if is_first or event.finish is not None or event.top_logprobs or len(probs) != len(tokens):
            _add_response(add, event, is_first, tag)
            continue
        tags.append(tag)
        counts.append(len(tokens))
        ids += tokens
        logprobs += probs
    if tags:
        batch.packed_tags.extend(tags)
        batch.packed_num_tokens.extend(counts)
        batch.packed_token_ids.extend(ids)
        batch.packed_logprobs.extend(logprobs)
    return batch
