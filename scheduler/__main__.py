"""``python -m scheduler``: continuous batching across the registry's workers."""

from __future__ import annotations

import asyncio
import sys

from canteen.config import parse_config
from canteen.local_socket import SCHEDULER_NAME, message_server
from canteen.logging import configure_logging
from canteen.malloc import silence_protobuf_trim
from canteen.metrics import new_registry, start_metrics_http
from canteen.server import ServiceRuntime
from canteen.tls import Policy, Tls
from canteen.tracing import configure_tracing, shutdown_tracing
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.link import LinkSettings
from scheduler.metrics import PoolCollector, SchedulerMetrics
from scheduler.router import WorkerPool
from scheduler.server import SchedulerServicer
from scheduler.service import SchedulerService

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Only the gateway submits work: behind it sit the keys, the rate limits and the screen.
POLICY = Policy.of(
    Generate=["gateway"], Subscribe=["gateway"], Connect=["gateway"], GetStats=["gateway", "client"]
)


async def serve(config: SchedulerConfig, tls: Tls | None) -> None:
    runtime = ServiceRuntime(
        SERVICE_NAME,
        f"{config.host}:{config.port}",
        config.grace,
        # A gateway's shared token stream lives as long as the gateway: a drain waits for
        # the Generate calls whose tokens ride on it, not for it; a Connect stream's
        # requests are counted one by one (scheduler/mux.py).
        untracked=(f"/{SERVICE_NAME}/Subscribe", f"/{SERVICE_NAME}/Connect"),
        credentials=tls.server_credentials() if tls else None,
        policy=POLICY if tls else None,
        health_port=config.health_port,
    )
    settings = LinkSettings(config.batch(), config.prefix_cache, config.worker_timeout)
    registry = new_registry()
    metrics = SchedulerMetrics(registry)
    pool = WorkerPool(
        config.registry,
        settings,
        runtime.set_ready,
        metrics.observe_step,
        config.failover_wait,
        tls,
    )
    registry.register(PoolCollector(pool.links))
    service = SchedulerService(pool, config.max_queue, metrics)
    servicer = SchedulerServicer(service, runtime)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, runtime.server)
    await runtime.start([SERVICE_NAME])
    # Connect on a private socket too, for gateways on this host and user
    local = message_server(
        "canteen-scheduler-",
        SCHEDULER_NAME,
        scheduler_pb2.ConnectRequest.FromString,
        lambda requests: servicer.connect_stream(requests, "unix"),
    )
    if config.local_link == "auto":
        servicer.local_socket = await local.start()

    async def stop_listening() -> None:
        local.stop_listening()  # the open streams run on while the drain lasts

    runtime.on_drain(stop_listening)
    metrics_http = await start_metrics_http(registry, config.host, config.metrics_port)
    watcher = asyncio.create_task(pool.watch_forever())
    await runtime.wait()
    local.close()
    watcher.cancel()
    if metrics_http is not None:
        await metrics_http[0].cleanup()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        SchedulerConfig, argv, prog="python -m scheduler", description="Canteen scheduler"
    )
    configure_logging("scheduler")
    silence_protobuf_trim()  # canteen/malloc.py
    tls = config.load_tls("scheduler")
    configure_tracing("canteen-scheduler", config.otlp_endpoint, tls)
    asyncio.run(serve(config, tls))
    shutdown_tracing()
    sys.exit(0)


if __name__ == "__main__":
    main()
