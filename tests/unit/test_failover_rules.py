"""Failover's bookkeeping without processes: placing, waiting, deadlines, giving up."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from canteen.finish import Finish
from canteen.plan import Sampling
from scheduler.failover import MAX_FAILOVERS, Failover
from scheduler.sequence import SeqEvent, Sequence, Status


@dataclass
class Desc:
    worker_id: str
    model: str = "m"
    version: str = "v1"


@dataclass
class FakeLink:
    desc: Desc
    adopted: list[Sequence] = field(default_factory=list)

    def adopt(self, seq: Sequence, queue: asyncio.Queue[SeqEvent]) -> None:
        self.adopted.append(seq)


def _orphan(deadline: float | None = None) -> tuple[Sequence, asyncio.Queue[SeqEvent]]:
    seq = Sequence("r1", [1, 2, 3], 8, Sampling(temperature=0.0), output_ids=[7, 8])
    seq.deadline = deadline
    return seq, asyncio.Queue()


def _lose(failover: Failover, seq: Sequence, queue: asyncio.Queue[SeqEvent]) -> None:
    """Its worker is lost: the worker's batcher counts the loss (``evict_all``), then
    failover takes it."""
    seq.num_failovers += 1
    failover.on_lost(FakeLink(Desc("a")), [(seq, queue)])  # type: ignore[arg-type]


def test_a_lost_sequence_goes_to_a_ready_worker_with_its_tokens() -> None:
    target = FakeLink(Desc("b"))
    failover = Failover(lambda model, version, seq: target, max_wait=30)  # type: ignore[arg-type,return-value]
    seq, queue = _orphan()
    failover.on_lost(FakeLink(Desc("a")), [(seq, queue)])  # type: ignore[arg-type]
    assert target.adopted == [seq] and seq.output_ids == [7, 8]
    assert failover.num_moved == 1 and not failover.waiting


def test_without_a_worker_it_waits_then_fails_at_the_callers_deadline() -> None:
    placed: dict[str, Any] = {"link": None}
    failover = Failover(lambda model, version, seq: placed["link"], max_wait=30)
    seq, queue = _orphan(deadline=100.0)
    failover.on_lost(FakeLink(Desc("a")), [(seq, queue)])  # type: ignore[arg-type]
    assert len(failover.waiting) == 1
    assert failover.waiting[0].deadline == 100.0  # the caller's deadline, not --failover-wait
    failover.expire(99.9)
    assert failover.waiting and queue.empty()
    failover.expire(100.0)
    event = queue.get_nowait()
    assert event.finish is Finish.FAILED and seq.status is Status.FINISHED
    assert event.error == (
        "worker a was lost and no other ready worker serves m:v1; gave up after waiting for one"
    )


def test_a_waiting_sequence_is_placed_when_a_worker_appears_or_dropped_on_cancel() -> None:
    placed: dict[str, Any] = {"link": None}
    failover = Failover(lambda model, version, seq: placed["link"], max_wait=30)
    first, q1 = _orphan()
    second, q2 = _orphan()
    second.request_id = "r2"
    failover.on_lost(FakeLink(Desc("a")), [(first, q1), (second, q2)])  # type: ignore[arg-type]
    assert failover.cancel(second) and second.finish is Finish.CANCELLED
    placed["link"] = FakeLink(Desc("c"))
    failover.retry()
    assert placed["link"].adopted == [first] and not failover.waiting
    assert not failover.cancel(first)  # no longer waiting here


def test_a_sequence_whose_workers_keep_dying_is_failed_not_moved() -> None:
    target = FakeLink(Desc("b"))
    failover = Failover(lambda model, version, seq: target, max_wait=30)  # type: ignore[arg-type,return-value]
    seq, queue = _orphan()
    for _ in range(MAX_FAILOVERS):
        _lose(failover, seq, queue)
    assert len(target.adopted) == MAX_FAILOVERS and queue.empty()
    _lose(failover, seq, queue)
    assert len(target.adopted) == MAX_FAILOVERS
    event = queue.get_nowait()
    assert event.finish is Finish.FAILED
    assert "it was on 4 workers that were lost" in event.error
