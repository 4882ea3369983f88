"""Protobuf translation of the scheduler's side of the Worker/Run stream."""

from __future__ import annotations

from canteen.codec import sampling_to_pb
from canteen.plan import FailedSequence, SampledToken, StepPlan, StepResult
from canteen.v1 import worker_pb2


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_sequences=[
            worker_pb2.NewSequence(
                seq_id=n.seq_id,
                token_ids=n.token_ids,
                sampling=sampling_to_pb(n.sampling),
                block_ids=n.block_ids,
                num_cached_tokens=n.num_cached_tokens,
                traceparent=n.traceparent,
                request_id=n.request_id,
                num_prompt_tokens=n.num_prompt_tokens,
            )
            for n in plan.new_sequences
        ],
        scheduled=[
            worker_pb2.ScheduledSequence(
                seq_id=s.seq_id,
                num_tokens=s.num_tokens,
                new_block_ids=s.new_block_ids,
                num_draft_tokens=s.num_draft_tokens,
            )
            for s in plan.scheduled
        ],
        dropped_seq_ids=plan.dropped_seq_ids,
    )


def result_from_pb(msg: worker_pb2.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        tokens=tuple(
            SampledToken(
                t.seq_id,
                t.token_id,
                t.logprob,
                tuple(zip(t.top.token_ids, t.top.logprobs, strict=True)),
            )
            for t in msg.tokens
        ),
        failed=tuple(FailedSequence(f.seq_id, f.error) for f in msg.failed),
        num_tokens=msg.num_tokens,
        forward_ns=msg.timings.forward_ns,
        sample_ns=msg.timings.sample_ns,
        total_ns=msg.timings.total_ns,
        num_draft_tokens=msg.num_draft_tokens,
        num_accepted_tokens=msg.num_accepted_tokens,
        num_proposed=dict(msg.num_proposed),
    )
