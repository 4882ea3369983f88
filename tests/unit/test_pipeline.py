"""Pipelined steps: the next plan is built while the worker computes the previous one."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from canteen.batching import BatchConfig
from canteen.codec import plan_from_pb, result_to_pb
from canteen.finish import Finish
from canteen.plan import StepPlan
from canteen.v1 import worker_pb2
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.link import LinkSettings, WorkerDescription, WorkerLink
from scheduler.sequence import SeqEvent, Sequence
from tests.unit.test_batcher import BLOCK_SIZE, FakeWorker, expected_tokens, make_seq


def pipelined(num_blocks: int = 64, max_batched_tokens: int = 64) -> BatchScheduler:
    limits = BatchConfig(
        max_batched_tokens=max_batched_tokens, max_num_seqs=16, max_step_stall=0, pipeline_depth=2
    )
    return BatchScheduler(BlockPool(num_blocks, BLOCK_SIZE), limits)


def pump(sched: BatchScheduler, worker: FakeWorker, sent: deque[StepPlan]) -> None:
    """Fills the pipeline, then lets the worker answer the oldest plan."""
    while (plan := sched.schedule()) is not None:
        sent.append(plan)
    if sent:
        sched.update(worker.step(sent.popleft()))


def test_the_next_decode_is_planned_before_the_previous_step_returns() -> None:
    sched, worker = pipelined(), FakeWorker(64)
    seq = make_seq("a", prompt_len=5, max_tokens=4)
    sched.add(seq)
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None
    assert sched.schedule() is None  # two in flight: the pipeline is full
    assert [(s.seq_id, s.num_tokens) for s in first.scheduled] == [("a", 5)]
    # The token step 1 samples is not known yet; step 2 computes it all the same.
    assert [(s.seq_id, s.num_tokens) for s in second.scheduled] == [("a", 1)]
    sent = deque([first, second])
    while not seq.is_finished:
        pump(sched, worker, sent)
    assert seq.finish is Finish.LENGTH
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 4)
    # No plan ever computed past max_tokens: 5 prompt tokens, then 3 decodes.
    computed = [s.num_tokens for p in worker.plans for s in p.scheduled if s.seq_id == "a"]
    assert computed == [5, 1, 1, 1]


def test_a_stop_token_costs_one_wasted_step_then_a_drop() -> None:
    prompt_probe = make_seq("s", prompt_len=6, max_tokens=50)
    stop = expected_tokens(prompt_probe.prompt_ids, 3)[2]
    sched, worker = pipelined(), FakeWorker(64)
    seq = make_seq("s", prompt_len=6, max_tokens=50, stop_token_ids=frozenset({stop}))
    sched.add(seq)
    sent: deque[StepPlan] = deque()
    while not seq.is_finished:
        pump(sched, worker, sent)
    assert seq.finish is Finish.STOP
    assert seq.output_ids == expected_tokens(seq.prompt_ids, 2)
    assert seq.block_ids == [] and sched.pool.num_free == 64
    while sent or sched.has_work:
        pump(sched, worker, sent)
    assert worker.seqs == {}  # dropped on the worker a step later
    assert sched.pool.num_free == 64


NUM_BLOCKS = 8
KINDS = ["add", "add", "step", "step", "step", "step", "cancel"]
ops = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(1, 16),
        st.integers(1, 10),
        st.integers(0, 2),
        st.integers(0, 100),
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_pipelined_streams_are_exact_and_blocks_all_come_back(
    operations: list[tuple[str, int, int, int, int]],
) -> None:
    # A small pool: sequences preempt each other while their plans are in flight.
    sched, worker = pipelined(NUM_BLOCKS, max_batched_tokens=8), FakeWorker(NUM_BLOCKS)
    seqs: list[Sequence] = []
    sent: deque[StepPlan] = deque()
    for kind, prompt_len, max_tokens, priority, pick in operations:
        live = [s for s in seqs if not s.is_finished]
        if kind == "add":
            seq = make_seq(
                f"r{len(seqs)}", prompt_len, max_tokens, priority, arrival_time=len(seqs)
            )
            seqs.append(seq)
            sched.add(seq)
        elif kind == "step":
            pump(sched, worker, sent)
        elif kind == "cancel" and live:
            sched.cancel(live[pick % len(live)])
        held = [b for s in seqs for b in s.block_ids]
        assert len(held) == len(set(held)) and sched.pool.num_free + len(held) == NUM_BLOCKS
    for _ in range(500):
        if not (sent or sched.has_work):
            break
        pump(sched, worker, sent)
    assert not sent and not sched.has_work
    assert sched.pool.num_free == NUM_BLOCKS
    assert worker.seqs == {}
    for seq in seqs:
        assert seq.is_finished
        assert seq.output_ids == expected_tokens(seq.prompt_ids, len(seq.output_ids))
        if seq.finish is Finish.LENGTH:
            assert len(seq.output_ids) == seq.max_tokens


def test_a_short_request_still_leaves_its_prompt_in_the_prefix_cache() -> None:
    # max_tokens=2: the plan sampling its last token is sent before the prefill returns,
    # and gives the blocks back at once; the prompt's full blocks must stay cached.
    limits = BatchConfig(max_batched_tokens=64, max_num_seqs=16, max_step_stall=0)
    sched = BatchScheduler(BlockPool(64, BLOCK_SIZE, enable_prefix_cache=True), limits)
    worker = FakeWorker(64)
    first = make_seq("first", prompt_len=13, max_tokens=2)
    sched.add(first)
    sent: deque[StepPlan] = deque()
    while not first.is_finished or sent:
        pump(sched, worker, sent)
    assert first.output_ids == expected_tokens(first.prompt_ids, 2)
    again = make_seq("first", prompt_len=13, max_tokens=2)  # the same prompt
    again.seq_id = "again"
    sched.add(again)
    while not again.is_finished or sent or sched.has_work:
        pump(sched, worker, sent)
    assert again.num_cached_tokens == 12  # three full blocks of 4
    assert again.output_ids == expected_tokens(again.prompt_ids, 2)


class _RunCall:
    """The worker's Run stream as the link sees it: plans written are answered in order by
    the fake worker; ``log`` records each plan written and each token delivered."""

    def __init__(self, worker: FakeWorker, log: list[str]) -> None:
        self.worker, self.log = worker, log
        self.plans: deque[StepPlan] = deque()

    async def write(self, wire: bytes) -> None:  # the link writes a plan's wire bytes
        plan = plan_from_pb(worker_pb2.StepPlan.FromString(wire))
        self.log.append(f"plan {plan.step_id}")
        self.plans.append(plan)
        await asyncio.sleep(0)  # a real write yields while the message goes out

    async def read(self) -> worker_pb2.StepResult:
        await asyncio.sleep(0)
        return result_to_pb(self.worker.step(self.plans.popleft()))

    async def done_writing(self) -> None:
        return None

    def cancel(self) -> None:
        return None


async def test_after_a_result_the_next_plan_is_written_before_its_token_is_delivered() -> None:
    """The worker's next step never waits for the gateway's write of the last token."""
    desc = WorkerDescription(
        "w", "127.0.0.1:1", "m", "v1", 64, BLOCK_SIZE, 256, frozenset(), 64, 128
    )
    limits = BatchConfig(max_batched_tokens=64, max_num_seqs=16, pipeline_depth=2)
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never dialled: the call is fake
    link = WorkerLink(desc, channel, LinkSettings(batch=limits))
    log: list[str] = []
    seq = make_seq("a", prompt_len=5, max_tokens=6)
    events: asyncio.Queue[SeqEvent] = asyncio.Queue()
    link.adopt(seq, events)
    runs = asyncio.create_task(link._loop(_RunCall(FakeWorker(64), log)))
    tokens: list[int] = []
    while not (event := await events.get()).finish:
        tokens += event.token_ids
        log.append(f"token {len(tokens)}")
    tokens += event.token_ids
    runs.cancel()
    await channel.close()
    assert tokens == expected_tokens(seq.prompt_ids, 6)
    # result i (token i) made room for plan i + 2: it is on the wire before token i goes out
    for i in range(1, 5):
        assert log.index(f"plan {i + 2}") < log.index(f"token {i}"), log
