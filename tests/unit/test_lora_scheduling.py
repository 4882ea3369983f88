"""LoRA adapters in the scheduler: prefix-cache isolation, the --max-loras limit on a batch,
routing to a worker that holds the adapter, and the refusal when no worker serves adapters.

The fake worker (tests/unit/test_prefix_cache.py) keeps real slot contents, so a block shared
by mistake would change the tokens; here the adapter changes only which blocks may be shared.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from canteen.adapters import AdapterRef
from canteen.batching import BatchConfig
from canteen.plan import Sampling, StepPlan, StepResult
from canteen.request import Request
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.link import LinkSettings, WorkerDescription, WorkerLink
from scheduler.lora import ADAPTER_LOAD_TOKENS
from scheduler.router import WorkerPool, pick_worker
from scheduler.sequence import Sequence
from scheduler.server import STATUS_OF
from scheduler.service import AdapterNotServedError, InvalidRequestError, SchedulerService
from tests.unit.test_prefix_cache import BS, ONE_AT_A_TIME, KVWorker, expected, make, run

SQL = AdapterRef("sql-writer", "v1", "/models/sql", "a" * 64)
POEM = AdapterRef("poet", "v1", "/models/poet", "b" * 64)
CHAT = AdapterRef("chatty", "v2", "/models/chatty", "c" * 64)
PREFIX = list(range(40, 52))  # three full blocks of 4


def seq(rid: str, prompt: list[int], adapter: AdapterRef | None, max_tokens: int = 4) -> Sequence:
    return Sequence(
        rid, list(prompt), max_tokens, Sampling(temperature=0.0), seq_id=rid, adapter=adapter
    )


def test_two_adapters_of_one_base_never_share_prefix_blocks_and_one_adapter_does() -> None:
    sched, worker = make(64), KVWorker()
    first = seq("sql-1", [*PREFIX, 1], SQL)
    sched.add(first)
    run(sched, worker)
    other = seq("poem", [*PREFIX, 2], POEM)
    base = seq("base", [*PREFIX, 3], None)
    same = seq("sql-2", [*PREFIX, 4], SQL)
    for s in (other, base, same):
        sched.add(s)
        run(sched, worker)
    assert [s.num_cached_tokens for s in (first, other, base, same)] == [0, 0, 0, 12]
    assert [worker.new_cached[s.seq_id] for s in (other, base, same)] == [0, 0, 12]
    assert same.output_ids == expected(same.prompt_ids, 4)
    # a version re-registered with other weights (another digest) is another adapter
    rewritten = seq("sql-3", [*PREFIX, 5], dataclasses.replace(SQL, sha256="d" * 64))
    sched.add(rewritten)
    run(sched, worker)
    assert rewritten.num_cached_tokens == 0


def test_a_new_sequence_carries_its_adapter_to_the_worker() -> None:
    sched = make(64)
    sched.add(seq("a", [1, 2, 3], SQL))
    sched.add(seq("b", [4, 5, 6], None))
    plan = sched.schedule()
    assert plan is not None
    assert [(n.seq_id, n.adapter) for n in plan.new_sequences] == [("a", SQL), ("b", None)]


def _limited(max_loras: int) -> BatchScheduler:
    pool = BlockPool(64, BS, enable_prefix_cache=True)
    limits = BatchConfig(max_batched_tokens=256, max_num_seqs=16, **ONE_AT_A_TIME)
    return BatchScheduler(pool, limits, max_loras=max_loras)


def test_a_step_mixes_at_most_max_loras_adapters_and_every_sequence_finishes() -> None:
    sched, worker = _limited(2), KVWorker()
    seqs = [
        seq("sql", [1, 2, 3], SQL, max_tokens=3),
        seq("poem", [4, 5, 6], POEM, max_tokens=6),
        seq("chat", [7, 8, 9], CHAT, max_tokens=3),
        seq("base", [10, 11], None, max_tokens=3),
        seq("sql-2", [12, 13], SQL, max_tokens=3),
    ]
    by_id = {s.seq_id: s for s in seqs}
    for s in seqs:
        sched.add(s)
    mixes: list[set[str]] = []
    for _ in range(100):
        plan = sched.schedule()
        if plan is None:
            break
        adapters = {by_id[i.seq_id].adapter_id for i in plan.scheduled} - {""}
        mixes.append(adapters)
        sched.update(worker.step(plan))
    assert all(len(m) <= 2 for m in mixes)
    # the first step runs the two first adapters, the base and the second sql request;
    # chatty waits for an adapter to leave the batch
    assert mixes[0] == {"sql-writer:v1", "poet:v1"}
    assert any("chatty:v2" in m for m in mixes)
    assert all(s.is_finished and s.output_ids == expected(s.prompt_ids, s.max_tokens) for s in seqs)


def _resident(core: BatchScheduler, *ids: str) -> None:
    """The worker reports its loaded adapters with a step's result."""
    core.add(seq("warm", [99], None, max_tokens=1))
    worker = KVWorker()
    plan = core.schedule()
    assert plan is not None
    result = worker.step(plan)
    core.update(dataclasses.replace(result, resident_adapters=ids, adapters_changed=True))
    run(core, worker)


def test_routing_prefers_a_worker_holding_the_adapter_while_it_has_room() -> None:
    cold, holder = make(64), make(32)
    _resident(holder, SQL.id)
    assert holder.resident_adapters == {SQL.id}
    assert pick_worker([cold, holder], [1, 2, 3], adapter_id=SQL.id) == 1
    assert pick_worker([cold, holder], [1, 2, 3], adapter_id=POEM.id) == 0  # most headroom
    assert pick_worker([cold, holder], [1, 2, 3]) == 0
    queued = make(16)
    queued.add(seq("waiting", [5, 6], POEM))  # will load it for this work
    assert pick_worker([cold, queued], [1, 2, 3], adapter_id=POEM.id) == 1
    # a holder without room for the prompt spills over to the others
    long_prompt = list(range(100, 200))  # 25 blocks; the holder has 16
    assert pick_worker([cold, queued], long_prompt, adapter_id=POEM.id) == 0


def test_an_adapter_report_replaces_the_last_one() -> None:
    core = make(32)
    _resident(core, SQL.id, POEM.id)
    _resident(core, POEM.id)
    assert core.resident_adapters == {POEM.id}
    core.add(seq("w", [1], None, max_tokens=1))
    plan = core.schedule()
    assert isinstance(plan, StepPlan)
    core.update(StepResult(plan.step_id, (), plan.num_tokens))  # said nothing: unchanged
    assert core.resident_adapters == {POEM.id}


def _desc(worker_id: str, max_loras: int) -> WorkerDescription:
    return WorkerDescription(
        worker_id, "127.0.0.1:1", "base", "v1", 64, BS, 256, frozenset({0}), 64, 128,
        max_loras=max_loras,
    )  # fmt: skip


async def _service(*max_loras: int) -> SchedulerService:
    async def ready(_: bool) -> None:
        return None

    pool = WorkerPool("127.0.0.1:1", LinkSettings(), ready)
    for i, n in enumerate(max_loras):
        channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never dialled here
        pool.links[f"w{i}"] = WorkerLink(_desc(f"w{i}", n), channel, LinkSettings())
    return SchedulerService(pool, max_queue=8)


async def test_a_request_with_an_adapter_is_refused_when_no_worker_serves_adapters() -> None:
    service = await _service(0, 0)
    request = Request("r1", "base", (1, 2, 3), 4, Sampling(), adapter=SQL)
    with pytest.raises(AdapterNotServedError) as caught:
        service._admit(request, "")
    assert str(caught.value) == (
        "adapter='sql-writer:v1': no ready worker of model 'base' serves LoRA adapters "
        "(its workers run with --max-loras 0)"
    )
    assert STATUS_OF[AdapterNotServedError] is grpc.StatusCode.FAILED_PRECONDITION
    link, plain = service._admit(dataclasses.replace(request, adapter=None), "")
    assert plain.adapter is None and link.desc.worker_id in {"w0", "w1"}


async def test_a_request_with_an_adapter_goes_to_a_worker_that_serves_adapters() -> None:
    service = await _service(0, 4)
    request = Request("r1", "base", (1, 2, 3), 4, Sampling(), adapter=SQL)
    link, sequence = service._admit(request, "")
    assert link.desc.worker_id == "w1" and sequence.adapter == SQL
    assert link.core.max_loras == 4
    assert service.pool.links["w0"].core.max_loras is None


def test_admission_counts_an_adapter_load_as_work() -> None:
    def first_plan(resident: frozenset[str]) -> dict[str, int]:
        pool = BlockPool(64, BS)
        limits = BatchConfig(max_batched_tokens=64, max_num_seqs=8, **ONE_AT_A_TIME)
        sched = BatchScheduler(pool, limits, max_loras=4)
        sched.resident_adapters = resident
        sched.add(seq("sql", list(range(1, 9)), SQL))
        sched.add(seq("sql-2", list(range(9, 13)), SQL))  # the same load: counted once
        sched.add(seq("base", list(range(100, 140)), None))
        plan = sched.schedule()
        assert plan is not None
        return {s.seq_id: s.num_tokens for s in plan.scheduled}

    # 64 tokens: 8 + 4 for the sql prompts, 32 for loading sql-writer, 20 of the base prompt
    assert first_plan(frozenset()) == {"sql": 8, "sql-2": 4, "base": 64 - 12 - ADAPTER_LOAD_TOKENS}
    assert first_plan(frozenset({SQL.id})) == {"sql": 8, "sql-2": 4, "base": 40}


async def test_an_adapter_without_its_digest_is_refused_naming_the_fields() -> None:
    service = await _service(4)
    unsigned = dataclasses.replace(SQL, sha256="")
    request = Request("r1", "base", (1, 2, 3), 4, Sampling(), adapter=unsigned)
    with pytest.raises(InvalidRequestError) as caught:
        service._admit(request, "")
    assert str(caught.value) == "adapter='sql-writer': version, path and sha256 are all required"
