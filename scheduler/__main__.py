"""``python -m scheduler``: continuous batching across the registry's workers."""

from __future__ import annotations

import asyncio
import sys

from canteen.config import parse_config
from canteen.logging import configure_logging
from canteen.server import ServiceRuntime
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.link import LinkSettings
from scheduler.router import WorkerPool
from scheduler.server import SchedulerServicer
from scheduler.service import SchedulerService

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


async def serve(config: SchedulerConfig) -> None:
    runtime = ServiceRuntime(SERVICE_NAME, f"{config.host}:{config.port}", config.grace)
    settings = LinkSettings(config.max_num_seqs, config.prefix_cache, config.max_step_stall)
    pool = WorkerPool(config.registry, settings, runtime.set_ready)
    service = SchedulerService(pool, config.max_queue)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(service), runtime.server)
    await runtime.start([SERVICE_NAME])
    watcher = asyncio.create_task(pool.watch_forever())
    await runtime.wait()
    watcher.cancel()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        SchedulerConfig, argv, prog="python -m scheduler", description="Canteen scheduler"
    )
    configure_logging("scheduler")
    asyncio.run(serve(config))
    sys.exit(0)


if __name__ == "__main__":
    main()
