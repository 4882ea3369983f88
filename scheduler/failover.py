"""Failover: the sequences of a lost worker run on, from prompt plus generated tokens.

When a worker's stream breaks (killed, crashed, or silent past ``--worker-timeout``), its
link hands every unfinished sequence here with the queue its caller reads. Each goes to
another ready worker of the same model version, which recomputes its KV from the tokens so
far; sampling depends only on (seed, position), so a greedy or seeded stream continues with
exactly the tokens it would have produced, and the caller sees no gap but time. With no such
worker a sequence waits here until one registers, or until its deadline (the caller's, else
``--failover-wait``), then fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from canteen.finish import Finish
from canteen.logging import get_logger
from scheduler.batcher import end_unplaced
from scheduler.link import Orphans, WorkerLink
from scheduler.sequence import Sequence
from scheduler.subscriptions import EventSink

log = get_logger(__name__)


@dataclass
class Waiting:
    seq: Sequence
    queue: EventSink
    model: str
    version: str
    lost_worker: str
    deadline: float


Placer = Callable[[str, str, Sequence], WorkerLink | None]


MAX_FAILOVERS = 3  # a sequence whose workers keep dying is failed, not moved again


class Failover:
    def __init__(self, place: Placer, max_wait: float) -> None:
        self._place = place  # a ready worker of (model, version) that fits the sequence
        self.max_wait = max_wait
        self.waiting: list[Waiting] = []
        self.num_moved = 0

    def on_lost(self, link: WorkerLink, orphans: Orphans) -> None:
        now = time.monotonic()
        for seq, queue in orphans:
            deadline = min(seq.deadline or now + self.max_wait, now + self.max_wait)
            item = Waiting(
                seq, queue, link.desc.model, link.desc.version, link.desc.worker_id, deadline
            )
            if seq.num_failovers > MAX_FAILOVERS:
                self._give_up(item, f"it was on {seq.num_failovers} workers that were lost")
            elif not self._try(item):
                log.warning(
                    "sequence waits for a worker",
                    request_id=seq.request_id,
                    model=f"{item.model}:{item.version}",
                )
                self.waiting.append(item)

    def retry(self) -> None:
        """Places waiting sequences (a worker became ready)."""
        self.waiting = [item for item in self.waiting if not self._try(item)]

    def cancel(self, seq: Sequence) -> bool:
        """Drops ``seq`` if it waits here; True if it did."""
        for item in self.waiting:
            if item.seq is seq:
                self.waiting.remove(item)
                end_unplaced(seq, Finish.CANCELLED)
                return True
        return False

    async def expire_forever(self, period: float = 0.2) -> None:
        while True:
            await asyncio.sleep(period)
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        for item in [i for i in self.waiting if i.deadline <= now]:
            self.waiting.remove(item)
            self._give_up(
                item,
                f"no other ready worker serves {item.model}:{item.version}; "
                "gave up after waiting for one",
            )

    def _give_up(self, item: Waiting, why: str) -> None:
        error = f"worker {item.lost_worker} was lost and {why}"
        item.queue.put_nowait(end_unplaced(item.seq, Finish.FAILED, error))

    def _try(self, item: Waiting) -> bool:
        link = self._place(item.model, item.version, item.seq)
        if link is None:
            return False
        link.adopt(item.seq, item.queue)
        self.num_moved += 1
        log.info(
            "sequence moved",
            request_id=item.seq.request_id,
            from_worker=item.lost_worker,
            to_worker=link.desc.worker_id,
            num_output_tokens=len(item.seq.output_ids),
        )
        return True
