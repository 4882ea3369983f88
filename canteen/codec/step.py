"""The worker contract (``Worker/Run``): ``StepPlan`` and ``StepResult`` <-> canteen/plan.py.

Fields travel by name (canteen/codec/fields.py); only what differs is written here: nested
messages (sampling, top logprobs, timings) and the failure message's other name.
"""

from __future__ import annotations

from canteen.codec.fields import from_pb, to_pb
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


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    return to_pb(
        plan,
        worker_pb2.StepPlan,
        new_sequences=[
            to_pb(n, worker_pb2.NewSequence, sampling=sampling_to_pb(n.sampling))
            for n in plan.new_sequences
        ],
        scheduled=[to_pb(s, worker_pb2.ScheduledSequence) for s in plan.scheduled],
    )


def plan_from_pb(msg: worker_pb2.StepPlan) -> StepPlan:
    return from_pb(
        msg,
        StepPlan,
        new_sequences=tuple(
            from_pb(n, NewSequence, sampling=sampling_from_pb(n.sampling))
            for n in msg.new_sequences
        ),
        scheduled=tuple(from_pb(s, ScheduledSequence) for s in msg.scheduled),
    )


def top_to_pb(top: tuple[tuple[int, float], ...]) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=[i for i, _ in top], logprobs=[lp for _, lp in top])


def top_from_pb(msg: common_pb2.TopLogprobs) -> tuple[tuple[int, float], ...]:
    return tuple(zip(msg.token_ids, msg.logprobs, strict=True))


def result_to_pb(result: StepResult) -> worker_pb2.StepResult:
    return to_pb(
        result,
        worker_pb2.StepResult,
        tokens=[
            # no top message at all when none was asked for
            to_pb(t, worker_pb2.SampledToken, top=top_to_pb(t.top) if t.top else None)
            for t in result.tokens
        ],
        failed=[to_pb(f, worker_pb2.SequenceFailure) for f in result.failed],
        timings=worker_pb2.StepTimings(
            forward_ns=result.forward_ns, sample_ns=result.sample_ns, total_ns=result.total_ns
        ),
    )


def result_from_pb(msg: worker_pb2.StepResult) -> StepResult:
    timings = msg.timings
    return from_pb(
        msg,
        StepResult,
        tokens=tuple(from_pb(t, SampledToken, top=top_from_pb(t.top)) for t in msg.tokens),
        failed=tuple(from_pb(f, FailedSequence) for f in msg.failed),
        forward_ns=timings.forward_ns,
        sample_ns=timings.sample_ns,
        total_ns=timings.total_ns,
    )
