"""A running registry, scheduler and gateway with named workers, as the integration tests'
module-scoped fixtures hold them, and the scheduler's GetStats by worker id."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.support.suite import Service, Suite


def worker_stats(scheduler_address: str) -> dict[str, scheduler_pb2.WorkerStats]:
    """The scheduler's GetStats, one entry per worker id."""
    with grpc.insecure_channel(scheduler_address) as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=5
        )
    return {w.worker_id: w for w in reply.workers}


@dataclass
class Stack:
    suite: Suite
    registry: Service
    scheduler: Service
    gateway: Service
    workers: dict[str, Service] = field(default_factory=dict)

    def start_worker(self, name: str, *args: str) -> Service:
        """Starts a worker of the tiny model named ``name`` with ``args``, and keeps it."""
        svc = self.suite.start_worker(self.registry, "tiny", *args, name=name)
        self.workers[name] = svc
        return svc

    def stats(self) -> dict[str, scheduler_pb2.WorkerStats]:
        return worker_stats(self.scheduler.address)
