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
