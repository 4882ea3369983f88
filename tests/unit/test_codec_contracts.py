"""canteen/codec: every internal message survives a trip through its protobuf and the wire
(domain -> pb -> bytes -> pb -> domain gives back the original), fields travel by name, and
a field added to both sides travels with no codec change."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from canteen import plan as domain
from canteen.adapters import AdapterRef
from canteen.codec import (
    PlanEncoder,
    plan_from_pb,
    plan_to_pb,
    request_from_pb,
    request_to_pb,
    response_to_pb,
    result_from_pb,
    result_to_pb,
    schedule,
)
from canteen.codec.fields import from_pb, to_pb
from canteen.finish import Finish
from canteen.plan import Constraint, NewSequence, Sampling, ScheduledSequence, StepPlan
from canteen.request import Request
from canteen.v1 import common_pb2, scheduler_pb2, worker_pb2
from scheduler import stats
from scheduler.link import WorkerDescription, describe
from scheduler.sequence import SeqEvent, Usage
from scheduler.worker_limits import WORKER_INFO_BOUNDS

INT32 = st.integers(0, 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=8)
FLOAT32 = st.floats(width=32, allow_nan=False)  # the wire's float holds these exactly
IDS = st.lists(INT32, max_size=6).map(tuple)
TOP = st.lists(st.tuples(INT32, FLOAT32), max_size=3).map(tuple)

CONSTRAINTS = st.one_of(
    st.none(),
    st.just(Constraint("json_object")),
    st.builds(Constraint, st.sampled_from(["json_schema", "regex", "grammar"]), TEXT),
    st.builds(Constraint, st.just("choice"), choices=st.lists(TEXT, min_size=1).map(tuple)),
)
SAMPLING = st.builds(Sampling, FLOAT32, FLOAT32, INT32, UINT64, INT32, CONSTRAINTS)
NEW = st.builds(NewSequence, TEXT, IDS, SAMPLING, IDS, INT32, TEXT, TEXT, INT32)
SCHEDULED = st.builds(ScheduledSequence, TEXT, INT32, IDS, INT32)
PLAN = st.builds(
    StepPlan,
    UINT64,
    st.lists(NEW, max_size=3).map(tuple),
    st.lists(SCHEDULED, max_size=3).map(tuple),
    st.lists(TEXT, max_size=3).map(tuple),
)
TOKEN = st.builds(domain.SampledToken, TEXT, INT32, FLOAT32, TOP)
RESULT = st.builds(
    domain.StepResult,
    UINT64,
    st.lists(TOKEN, max_size=3).map(tuple),
    INT32,
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**63 - 1),
    st.lists(st.builds(domain.FailedSequence, TEXT, TEXT), max_size=2).map(tuple),
    INT32,
    INT32,
    st.dictionaries(TEXT, INT32, max_size=3),
)
INT64 = st.integers(0, 2**63 - 1)
DESCRIPTION = st.builds(
    WorkerDescription,
    TEXT,
    TEXT,
    TEXT,
    TEXT,
    INT32,
    INT32,
    INT32,
    st.frozensets(INT32, max_size=4),
    INT32,
    INT32,
    INT32,
    INT64,
    INT64,
    INT64,
    INT64,
)
STATS = st.builds(
    stats.WorkerStats,
    *[TEXT] * 4,
    *[INT32] * 4,
    UINT64,
    st.booleans(),
    UINT64,
    INT32,
    st.floats(allow_nan=False),
    INT64,
    INT64,
    st.text(alphabet="UC.", max_size=16),
    st.lists(
        st.builds(stats.RunningSequence, TEXT, TEXT, INT32, INT32, INT32, st.booleans()),
        max_size=3,
    ).map(tuple),
    INT32,
)
REQUEST = st.builds(
    Request,
    request_id=TEXT,
    model=TEXT,
    prompt_token_ids=IDS,
    max_tokens=INT32,
    sampling=SAMPLING,
    version=TEXT,
    stop_token_ids=IDS,
    ignore_eos=st.booleans(),
    priority=st.integers(-(2**31), 2**31 - 1),
    cache_salt=TEXT,
    disable_speculation=st.booleans(),
)


@settings(max_examples=200)
@given(PLAN)
def test_a_step_plan_round_trips(plan: StepPlan) -> None:
    wire = plan_to_pb(plan).SerializeToString()
    assert plan_from_pb(worker_pb2.StepPlan.FromString(wire)) == plan


@settings(max_examples=200)
@given(st.lists(PLAN, min_size=1, max_size=4))
def test_the_plan_bytes_the_scheduler_writes_are_the_plan(plans: list[StepPlan]) -> None:
    """PlanEncoder's bytes parse to the very message plan_to_pb builds, step after step
    with the same encoder (entries reused), and the worker decodes the plan sent."""
    encode = PlanEncoder(max_entries=3)
    for plan in [*plans, *plans]:
        msg = worker_pb2.StepPlan.FromString(encode(plan))
        assert msg == plan_to_pb(plan)
        assert plan_from_pb(msg) == plan


def test_a_decoding_sequences_plan_entry_is_reused_and_the_cache_is_bounded() -> None:
    encode = PlanEncoder(max_entries=2)
    step = [ScheduledSequence(f"s{i}", 1) for i in range(3)]
    first = encode(StepPlan(1, scheduled=tuple(step)))
    again = encode(StepPlan(1, scheduled=tuple(ScheduledSequence(f"s{i}", 1) for i in range(3))))
    assert first == again
    for i in range(100):  # sequences that come and go: the entries kept stay bounded
        encode(StepPlan(i, scheduled=(ScheduledSequence(f"new{i}", 1),)))
        assert len(encode._entries) <= 2
    with_block = StepPlan(2, scheduled=(ScheduledSequence("s0", 1, (7,)), step[1]))
    decoded = plan_from_pb(worker_pb2.StepPlan.FromString(encode(with_block)))
    assert decoded.scheduled == (ScheduledSequence("s0", 1, (7,)), step[1])


@settings(max_examples=200)
@given(RESULT)
def test_a_step_result_round_trips(result: domain.StepResult) -> None:
    wire = result_to_pb(result).SerializeToString()
    assert result_from_pb(worker_pb2.StepResult.FromString(wire)) == result


@settings(max_examples=200)
@given(REQUEST)
def test_a_schedule_request_round_trips(request: Request) -> None:
    wire = request_to_pb(request).SerializeToString()
    assert request_from_pb(scheduler_pb2.ScheduleRequest.FromString(wire)) == request


@settings(max_examples=200)
@given(DESCRIPTION)
def test_a_worker_description_round_trips(desc: WorkerDescription) -> None:
    msg = to_pb(desc, worker_pb2.WorkerInfo, eos_token_ids=sorted(desc.eos_token_ids))
    wire = msg.SerializeToString()
    assert describe(worker_pb2.WorkerInfo.FromString(wire), desc.address) == desc


@settings(max_examples=200)
@given(STATS)
def test_worker_stats_round_trip(worker: stats.WorkerStats) -> None:
    """GetStats: the scheduler's plain stats value travels by name (scheduler/server.py)."""
    msg = to_pb(
        worker,
        scheduler_pb2.WorkerStats,
        running=[to_pb(r, scheduler_pb2.RunningSequence) for r in worker.running],
    )
    back = scheduler_pb2.WorkerStats.FromString(msg.SerializeToString())
    running = tuple(from_pb(r, stats.RunningSequence) for r in back.running)
    assert from_pb(back, stats.WorkerStats, running=running) == worker
    refused = stats.RefusedWorker("w", "127.0.0.1:1", "num_blocks=0: must be in 1..2")
    assert from_pb(to_pb(refused, scheduler_pb2.RefusedWorker), stats.RefusedWorker) == refused


def test_every_bounded_worker_number_is_in_the_description() -> None:
    info = worker_pb2.WorkerInfo(
        **{bound.field: i + 1 for i, bound in enumerate(WORKER_INFO_BOUNDS)}  # type: ignore[arg-type]
    )
    desc = describe(info, "127.0.0.1:9")
    assert [getattr(desc, b.field) for b in WORKER_INFO_BOUNDS] == list(
        range(1, len(WORKER_INFO_BOUNDS) + 1)
    )


def test_a_request_deadline_is_the_calls_time_left() -> None:
    msg = request_to_pb(Request("r", "m", (1,), 4, Sampling()))
    assert request_from_pb(msg).deadline is None
    got = request_from_pb(msg, time_remaining=30.0).deadline
    assert got is not None and 29 < got - time.monotonic() <= 30


def test_the_wire_carries_each_value_in_its_named_field() -> None:
    new = NewSequence("s1", (5, 6, 7), Sampling(0.5, seed=3), (2, 3), 1, "tp", "req", 2)
    plan = plan_to_pb(StepPlan(9, (new,), (ScheduledSequence("s1", 3, (4,), 2),), ("old",)))
    n, s = plan.new_sequences[0], plan.scheduled[0]
    assert (plan.step_id, list(plan.dropped_seq_ids)) == (9, ["old"])
    assert (n.seq_id, list(n.token_ids), list(n.block_ids)) == ("s1", [5, 6, 7], [2, 3])
    assert (n.num_cached_tokens, n.traceparent, n.request_id, n.num_prompt_tokens) == (
        1,
        "tp",
        "req",
        2,
    )
    assert (n.sampling.temperature, n.sampling.seed) == (0.5, 3)
    assert (s.seq_id, s.num_tokens, list(s.new_block_ids), s.num_draft_tokens) == ("s1", 3, [4], 2)
    step = domain.StepResult(
        4,
        tokens=(domain.SampledToken("s1", 8, -0.5),),
        forward_ns=10,
        sample_ns=20,
        total_ns=30,
        failed=(domain.FailedSequence("x", "no"),),
    )
    result = result_to_pb(step)
    timings = result.timings
    assert (timings.forward_ns, timings.sample_ns, timings.total_ns) == (10, 20, 30)
    assert not result.tokens[0].HasField("top")  # no alternatives asked, none sent
    assert (result.failed[0].seq_id, result.failed[0].error) == ("x", "no")


def test_a_response_carries_the_event_and_ends_with_finish_and_usage() -> None:
    top = ((1, -0.25), (2, -1.5))
    event = SeqEvent("s", (1,), (-0.25,), None, (top,), Usage(3, 1, 0), 0.5)
    first = response_to_pb(event, is_first=True, stream_tag=7)
    assert (list(first.token_ids), list(first.logprobs), first.stream_tag) == ([1], [-0.25], 7)
    assert (first.queue_seconds, first.finish_reason, first.HasField("usage")) == (0.5, 0, False)
    assert [(list(t.token_ids), list(t.logprobs)) for t in first.top_logprobs] == [
        ([1, 2], [-0.25, -1.5])
    ]
    assert response_to_pb(event, is_first=False).queue_seconds == 0.0  # sent once
    last = response_to_pb(SeqEvent("s", (), (), Finish.LENGTH, (), Usage(3, 4, 2)), False)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.usage.cached_tokens == 2


@dataclass(frozen=True)
class WiderRequest(Request):
    """``Request`` as it would be with two more fields that ``ScheduleRequest`` has."""

    subscription_id: str = ""
    stream_tag: int = 0


def test_a_field_added_to_both_sides_travels_with_no_codec_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wider = WiderRequest("r", "m", (1, 2), 4, Sampling(seed=1), subscription_id="sub", stream_tag=7)
    msg = request_to_pb(wider)
    assert (msg.subscription_id, msg.stream_tag) == ("sub", 7)
    monkeypatch.setattr(schedule, "Request", WiderRequest)
    assert request_from_pb(msg) == wider


def test_a_message_field_left_out_is_an_error_not_a_silent_drop() -> None:
    new = NewSequence("s", (1,), Sampling(), (0,))
    with pytest.raises(TypeError, match="field 'sampling' holds messages"):
        to_pb(new, worker_pb2.NewSequence)
    with pytest.raises(TypeError, match="field 'sampling' holds messages"):
        from_pb(worker_pb2.NewSequence(seq_id="s"), NewSequence)


# Each contract's fields that are not on both sides by name, and so are converted by hand
# (or, for the scheduler's subscription fields, read in scheduler/server.py).
TIMINGS = {"forward_ns", "sample_ns", "total_ns"}
ONE_SIDED = [
    (Sampling, common_pb2.SamplingParams, set(), set()),
    (StepPlan, worker_pb2.StepPlan, set(), set()),
    (NewSequence, worker_pb2.NewSequence, set(), set()),
    (ScheduledSequence, worker_pb2.ScheduledSequence, set(), set()),
    (domain.SampledToken, worker_pb2.SampledToken, set(), set()),
    (domain.FailedSequence, worker_pb2.SequenceFailure, set(), set()),
    (
        domain.StepResult,
        worker_pb2.StepResult,
        {"forward_ns", "sample_ns", "total_ns"},
        {"timings"},
    ),
    (
        Request,
        scheduler_pb2.ScheduleRequest,
        {"deadline"},
        {"subscription_id", "stream_tag", "stream_interval"},
    ),
    (Usage, common_pb2.Usage, set(), set()),
    (stats.WorkerStats, scheduler_pb2.WorkerStats, set(), set()),
    (stats.RunningSequence, scheduler_pb2.RunningSequence, set(), set()),
    (stats.RefusedWorker, scheduler_pb2.RefusedWorker, set(), set()),
    (
        WorkerDescription,
        worker_pb2.WorkerInfo,
        {"address"},
        {"device", "dtype", "dtype_reason", "quantization", "speculative"},
    ),
    (
        SeqEvent,
        scheduler_pb2.ScheduleResponse,
        {"seq_id", "finish", "error", "is_refused", "is_request_error"},
        {"finish_reason", "stream_tag", "failure"},
    ),
]


@pytest.mark.parametrize(("cls", "message", "only_domain", "only_pb"), ONE_SIDED)
def test_a_field_on_one_side_only_is_a_known_one(
    cls: type, message: type[Message], only_domain: set[str], only_pb: set[str]
) -> None:
    """A field added to one side and not the other fails here, not silently on the wire."""
    names = {f.name for f in fields(cls)}
    wire = set(message.DESCRIPTOR.fields_by_name)
    assert (names - wire, wire - names) == (only_domain, only_pb)


# Bytes the hand-written converters (before the by-name codec) gave for these two steps; the
# codec must not change the wire.
PLAN_BYTES = (
    "080912280a02733112030506071a0c0d0000003f150000803f2003220202032801320274703a037265714002"
    "1a0b0a02733110031a0104200222036f6c64"
)
RESULT_BYTES = (
    "0804121b0a02733110081d000000bf220e0a0208091208000000bf000000c0120b0a02733210011d000080bf"
    "18022206080a1014181e2a090a017812026e6f18013003380142060a0273311003"
)


def test_the_wire_bytes_of_fixed_steps_are_unchanged() -> None:
    new = NewSequence("s1", (5, 6, 7), Sampling(0.5, seed=3), (2, 3), 1, "tp", "req", 2)
    plan = StepPlan(9, (new,), (ScheduledSequence("s1", 3, (4,), 2),), ("old",))
    result = domain.StepResult(
        4,
        (
            domain.SampledToken("s1", 8, -0.5, ((8, -0.5), (9, -2.0))),
            domain.SampledToken("s2", 1, -1.0),
        ),
        2,
        10,
        20,
        30,
        (domain.FailedSequence("x", "no", True),),
        3,
        1,
        {"s1": 3},
    )
    assert plan_to_pb(plan).SerializeToString().hex() == PLAN_BYTES
    assert result_to_pb(result).SerializeToString().hex() == RESULT_BYTES
    assert plan_from_pb(worker_pb2.StepPlan.FromString(bytes.fromhex(PLAN_BYTES))) == plan
    assert result_from_pb(worker_pb2.StepResult.FromString(bytes.fromhex(RESULT_BYTES))) == result


def test_a_compiled_converter_refuses_a_field_it_cannot_name() -> None:
    @dataclass(frozen=True)
    class Odd:
        source: str = ""

    with pytest.raises(ValueError, match="cannot be compiled"):
        to_pb(Odd(), worker_pb2.StepPlan, source="x")


def test_an_adapter_travels_with_a_sequence_and_a_request() -> None:
    """The LoRA adapter (a nested message) survives both contracts; none stays none."""
    adapter = AdapterRef("sql-writer", "v1", "/models/sql", "ab" * 32)
    new = NewSequence("s1", (1, 2), Sampling(), (0,), adapter=adapter)
    plain = NewSequence("s2", (3,), Sampling(), (1,))
    plan = StepPlan(7, new_sequences=(new, plain))
    decoded = plan_from_pb(worker_pb2.StepPlan.FromString(plan_to_pb(plan).SerializeToString()))
    assert [n.adapter for n in decoded.new_sequences] == [adapter, None]
    request = Request("r", "base", (1,), 4, Sampling(), adapter=adapter)
    wire = scheduler_pb2.ScheduleRequest.FromString(request_to_pb(request).SerializeToString())
    assert request_from_pb(wire).adapter == adapter
    assert request_from_pb(scheduler_pb2.ScheduleRequest(model="base")).adapter is None
