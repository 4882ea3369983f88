"""The worker contract (``Worker/Run``): ``StepPlan`` and ``StepResult`` <-> canteen/plan.py.

Fields travel by name (canteen/codec/fields.py); only what differs is written here: nested
messages (sampling, top logprobs, timings) and the failure message's other name. These run
for every sequence of every step, so each holds its compiled converter, one call per
repeated field.
"""

from __future__ import annotations

from canteen.codec.adapter import adapter_from_pb, adapter_to_pb
from canteen.codec.fields import decoder, encoder, list_encoder, tuple_decoder
from canteen.codec.sampling import sampling_from_pb, sampling_to_pb
from canteen.plan import (
    FailedSequence,
    NewSequence,
    SampledToken,
    ScheduledSequence,
    StepPlan,
    StepResult,
)
from canteen.v1 import common_pb2, worker_pb2


def top_to_pb(top: tuple[tuple[int, float], ...]) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=[i for i, _ in top], logprobs=[lp for _, lp in top])


def top_from_pb(msg: common_pb2.TopLogprobs) -> tuple[tuple[int, float], ...]:
    return tuple(zip(msg.token_ids, msg.logprobs, strict=True))


_PLAN_TO = encoder(StepPlan, worker_pb2.StepPlan, "new_sequences", "scheduled")
_NEW_TO = list_encoder(
    NewSequence,
    worker_pb2.NewSequence,
    sampling=lambda n: sampling_to_pb(n.sampling),
    adapter=lambda n: adapter_to_pb(n.adapter),
)
_SCHEDULED_TO = list_encoder(ScheduledSequence, worker_pb2.ScheduledSequence)
_SCHEDULED_ONE = encoder(ScheduledSequence, worker_pb2.ScheduledSequence)
_PLAN_FROM = decoder(worker_pb2.StepPlan, StepPlan, "new_sequences", "scheduled")
_NEW_FROM = tuple_decoder(
    worker_pb2.NewSequence,
    NewSequence,
    sampling=lambda n: sampling_from_pb(n.sampling),
    adapter=lambda n: adapter_from_pb(n.adapter),
)
_SCHEDULED_FROM = tuple_decoder(worker_pb2.ScheduledSequence, ScheduledSequence)
_RESULT_TO = encoder(StepResult, worker_pb2.StepResult, "tokens", "failed", "timings")
_TOKEN_TO = list_encoder(  # no top message at all when none was asked for
    SampledToken, worker_pb2.SampledToken, top=lambda t: top_to_pb(t.top) if t.top else None
)
_FAILED_TO = list_encoder(FailedSequence, worker_pb2.SequenceFailure)
_RESULT_FROM = decoder(
    worker_pb2.StepResult, StepResult, "tokens", "failed", "forward_ns", "sample_ns", "total_ns"
)
_TOKEN_FROM = tuple_decoder(  # most steps ask no alternatives: then no top to read
    worker_pb2.SampledToken,
    SampledToken,
    top=lambda t: top_from_pb(t.top) if t.HasField("top") else (),
)
_FAILED_FROM = tuple_decoder(worker_pb2.SequenceFailure, FailedSequence)


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    return _PLAN_TO(
        plan, new_sequences=_NEW_TO(plan.new_sequences), scheduled=_SCHEDULED_TO(plan.scheduled)
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SCHEDULED_TAG = b"\x1a"  # StepPlan.scheduled: field 3, length-delimited


class PlanEncoder:
    """A plan's wire bytes, the ``StepPlan`` that ``plan_to_pb`` builds (the worker parses
    the same message), without a message per scheduled sequence: a decoding sequence is
    scheduled with the same entry step after step (its id, one token, no new block), so
    that entry's bytes are kept and reused. Entries with new blocks are encoded each time.
    The scheduled entries follow the plan's other fields on the wire; a parser reads a
    repeated field's entries in order wherever they stand."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._entries: dict[ScheduledSequence, bytes] = {}
        self._max_entries = max_entries

    def __call__(self, plan: StepPlan) -> bytes:
        entries = self._entries
        if len(entries) >= self._max_entries:  # finished sequences' entries go in bulk
            entries.clear()
        head = _PLAN_TO(plan, new_sequences=_NEW_TO(plan.new_sequences), scheduled=())
        wire = [head.SerializeToString()]
        for s in plan.scheduled:
            if s.new_block_ids:  # new blocks: an entry of this step only
                wire.append(_entry(s))
            elif (entry := entries.get(s)) is not None:
                wire.append(entry)
            else:
                wire.append(entries.setdefault(s, _entry(s)))
        return b"".join(wire)


def _entry(s: ScheduledSequence) -> bytes:
    body = _SCHEDULED_ONE(s).SerializeToString()
    return _SCHEDULED_TAG + _varint(len(body)) + body


def plan_from_pb(msg: worker_pb2.StepPlan) -> StepPlan:
    return _PLAN_FROM(
        msg, new_sequences=_NEW_FROM(msg.new_sequences), scheduled=_SCHEDULED_FROM(msg.scheduled)
    )


def result_to_pb(result: StepResult) -> worker_pb2.StepResult:
    return _RESULT_TO(
        result,
        tokens=_TOKEN_TO(result.tokens),
        failed=_FAILED_TO(result.failed),
        timings=worker_pb2.StepTimings(
            forward_ns=result.forward_ns, sample_ns=result.sample_ns, total_ns=result.total_ns
        ),
    )


def result_from_pb(msg: worker_pb2.StepResult) -> StepResult:
    timings = msg.timings
    return _RESULT_FROM(
        msg,
        tokens=_TOKEN_FROM(msg.tokens),
        failed=_FAILED_FROM(msg.failed),
        forward_ns=timings.forward_ns,
        sample_ns=timings.sample_ns,
        total_ns=timings.total_ns,
    )
