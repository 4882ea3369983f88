"""Prometheus metrics shared by the four services: one registry per process, served over HTTP.

Every name starts with ``canteen_``; labels stay bounded (model, version, worker id, a status or
kind from a fixed set), never request ids or user text. Each service defines its own metrics
in its ``metrics.py`` on the registry that ``new_registry`` returns, and serves it with
``start_metrics_http`` on ``--metrics-port`` (the gateway also on its HTTP port).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)

from canteen.logging import get_logger

log = get_logger(__name__)

# Seconds, for request-level latencies (TTFT, end to end, queue time).
REQUEST_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# Seconds, for per-token and per-step latencies (TPOT, ITL, step time).
TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.0, 5.0, 10.0,
)  # fmt: skip

METRICS_PORT_HELP = "port serving Prometheus /metrics (-1: off, 0: any free port)"


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and GC collectors and nothing else."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler rendering ``registry`` in the text exposition format.

    It runs on the event loop, so collectors read the services' state between steps.
    """

    async def handle(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


async def start_metrics_http(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[web.AppRunner, int] | None:
    """Serves ``GET /metrics`` on ``host:port``; None when ``port`` is -1 (off)."""
    if port < 0:
        return None
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1])
    log.info("metrics listening", host=host, port=bound)
    return runner, bound
