"""``python -m gateway``: the public canteen.v1.Inference edge."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import sys

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.admin_keys import WRITE, AdminKeys
from canteen.auth import ApiKeys
from canteen.config import parse_config
from canteen.logging import configure_logging, get_logger
from canteen.malloc import silence_protobuf_trim
from canteen.metrics import new_registry, start_metrics_http
from canteen.server import ServiceRuntime
from canteen.streams import follow_stream
from canteen.tls import Tls, aio_channel
from canteen.tracing import configure_tracing, shutdown_tracing
from canteen.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from gateway.catalog import ModelCatalog
from gateway.config import GatewayConfig
from gateway.http import HttpEdge, start_http
from gateway.metrics import GatewayMetrics
from gateway.screen import Screen, load_screen
from gateway.server import InferenceServicer
from gateway.service import InferenceService
from gateway.tokenizers import TokenizerCache

log = get_logger("gateway")
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def bind_host(config: GatewayConfig, keys: ApiKeys) -> str:
    """Where the public ports listen. Without API keys, loopback only, unless the operator
    says --allow-unauthenticated on purpose."""
    if not config.host:
        return "0.0.0.0" if keys.is_enabled else "127.0.0.1"
    if not keys.is_enabled and not _is_loopback(config.host):
        if not config.allow_unauthenticated:
            raise ValueError(
                f"host={config.host!r}: without API keys the gateway binds loopback only; "
                "give --api-keys-file (or CANTEEN_API_KEYS), or --allow-unauthenticated"
            )
        log.warning("serving without API keys on a non-loopback interface", host=config.host)
    return config.host


def public_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS of the public gRPC port (no client certificates: callers bring API keys)."""
    if not config.public_tls_cert:
        return None
    try:
        with open(config.public_tls_cert, "rb") as cert, open(config.public_tls_key, "rb") as key:
            return grpc.ssl_server_credentials([(key.read(), cert.read())])
    except OSError as exc:
        raise ValueError(f"public_tls: {exc.filename}: {exc.strerror}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def build_screen(config: GatewayConfig) -> Screen | None:
    """The configured content screen; a bad spec or config stops the gateway at start."""
    if not config.screen:
        return None
    try:
        options = json.loads(config.screen_config) if config.screen_config else None
    except json.JSONDecodeError as exc:
        raise ValueError(f"screen_config: not valid JSON: {exc}") from exc
    if options is not None and not isinstance(options, dict):
        raise ValueError("screen_config: must be a JSON object")
    spec = "gateway.screen:deny_list" if config.screen == "deny-list" else config.screen
    return load_screen(spec, options)


async def follow_scheduler(
    address: str, tls: Tls | None, runtime: ServiceRuntime, preload: asyncio.Future[None]
) -> None:
    """Readiness follows the scheduler's readiness (health Watch, reconnecting)."""

    async def on_status(msg: health_pb2.HealthCheckResponse) -> None:
        await preload
        await runtime.set_ready(msg.status == health_pb2.HealthCheckResponse.SERVING)

    async def on_broken() -> None:
        await runtime.set_ready(False)

    await follow_stream(
        lambda: aio_channel(address, tls, "scheduler"),
        lambda channel: health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE)
        ),
        on_status,
        "scheduler health",
        on_broken,
    )


def load_admin_keys(config: GatewayConfig) -> ApiKeys:
    """The keys of /status and /metrics. The gateway faces the internet, so it should hold
    only scope=read keys; it says which of its keys could also write to the registry."""
    admin = AdminKeys.load(config.admin_keys_file, config.admin_keys)
    if write_ids := admin.key_ids(WRITE):
        log.warning(
            "the gateway holds admin keys of scope=write (a line without scope= is a write "
            "key); give it scope=read keys only: /status and /metrics need no more",
            key_ids=write_ids,
        )
    return admin.keys


async def serve(config: GatewayConfig, tls: Tls | None) -> None:
    keys = ApiKeys.load(config.api_keys_file, config.api_keys)
    host = bind_host(config, keys)
    runtime = ServiceRuntime(
        SERVICE_NAME,
        f"{host}:{config.port}",
        config.grace,
        # The public port takes what the HTTP edge takes (the limit table's one body size).
        max_message_bytes=config.max_body_bytes,
        credentials=public_credentials(config),
        health_port=config.health_port,
        reuse_port=config.reuse_port,
    )
    catalog = ModelCatalog(config.registry, tls)
    tokenizers = TokenizerCache()
    channel = aio_channel(config.scheduler, tls, "scheduler")
    metrics_registry = new_registry()
    service = InferenceService(
        config,
        catalog,
        tokenizers,
        scheduler_pb2_grpc.SchedulerStub(channel),
        GatewayMetrics(metrics_registry),
        build_screen(config),
    )
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(service, keys), runtime.server
    )
    await runtime.start([SERVICE_NAME])
    admin_keys = load_admin_keys(config)
    edge = HttpEdge(
        service, keys, config.max_body_bytes, metrics_registry, admin_keys, config.suite_state
    )
    public = (config.public_tls_cert, config.public_tls_key) if config.public_tls_cert else None
    http = (
        await start_http(edge, host, config.http_port, public, config.reuse_port)
        if config.http_port >= 0
        else None
    )
    metrics_http = await start_metrics_http(metrics_registry, host, config.metrics_port)

    async def drain_http() -> None:
        edge.is_draining = True  # new HTTP requests get 503; streams already running go on

    runtime.on_drain(drain_http)
    watcher = asyncio.create_task(catalog.watch_forever())

    async def preload_default() -> None:
        await catalog.loaded.wait()
        if catalog.default_model:
            try:
                await tokenizers.get(catalog.resolve(""))
            except Exception as exc:  # the model may be registered later
                log.warning("default tokenizer not loaded", error=str(exc))
        log.info("tokenizer ready", model=catalog.default_model)

    preload = asyncio.ensure_future(preload_default())
    health = asyncio.create_task(follow_scheduler(config.scheduler, tls, runtime, preload))
    await runtime.wait()
    if http is not None:
        await _finish_http(edge, http, config.grace)
    if metrics_http is not None:
        await metrics_http[0].cleanup()
    for task in (watcher, health, preload):
        task.cancel()
    await service.upstream.close()
    service.admission.pool.close()
    await channel.close()


async def _finish_http(edge: HttpEdge, runner: web.AppRunner, grace: float) -> None:
    """Lets HTTP streams in flight finish within the grace period, then closes the port."""
    deadline = asyncio.get_running_loop().time() + grace
    while edge.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        GatewayConfig, argv, prog="python -m gateway", description="Canteen gateway"
    )
    configure_logging("gateway")
    silence_protobuf_trim()  # canteen/malloc.py
    tls = config.load_tls("gateway")
    configure_tracing("canteen-gateway", config.otlp_endpoint, tls)
    try:
        asyncio.run(serve(config, tls))
    except ValueError as exc:
        log.error("bad configuration", error=str(exc))
        sys.exit(2)
    finally:
        shutdown_tracing()
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
