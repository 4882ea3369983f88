"""``python -m registry``: the model registry and worker directory."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from canteen.admin_keys import AdminKeys
from canteen.config import parse_config
from canteen.logging import configure_logging, get_logger
from canteen.malloc import silence_protobuf_trim
from canteen.metrics import new_registry, start_metrics_http
from canteen.server import ServiceRuntime
from canteen.tls import Policy, Tls
from canteen.v1 import registry_pb2, registry_pb2_grpc
from registry.config import RegistryConfig
from registry.core import InvalidModelError, Registry
from registry.directory import WorkerDirectory
from registry.metrics import RegistryCollector
from registry.server import RegistryServicer
from registry.store import ModelStore

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
# Only workers hold leases. Writes to models and aliases need an admin key on top (server.py).
_WORKERS_ONLY = ["worker"]
POLICY = Policy.of(
    RegisterWorker=_WORKERS_ONLY, Heartbeat=_WORKERS_ONLY, DeregisterWorker=_WORKERS_ONLY
)


async def serve(config: RegistryConfig, tls: Tls | None) -> None:
    admin_keys = AdminKeys.load(config.admin_keys_file, config.admin_keys)
    roots = tuple(Path(r.strip()) for r in config.model_root.split(",") if r.strip())
    registry = Registry(
        ModelStore(config.db), WorkerDirectory(config.lease_ttl), config.default_model
    )
    if config.register_default:
        await registry.register_default_model()
    for spec in filter(None, config.add_model.split(",")):
        await registry.add_from_spec(spec.strip())
    registry.model_roots = tuple(root.expanduser().resolve() for root in roots)
    watches = tuple(f"/{SERVICE_NAME}/{m}" for m in ("WatchModels", "WatchWorkers"))
    runtime = ServiceRuntime(
        SERVICE_NAME,
        f"{config.host}:{config.port}",
        config.grace,
        untracked=watches,
        credentials=tls.server_credentials() if tls else None,
        policy=POLICY if tls else None,
        health_port=config.health_port,
    )
    registry_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(registry, admin_keys), runtime.server
    )
    await runtime.start([SERVICE_NAME])
    metrics_registry = new_registry()
    metrics_registry.register(RegistryCollector(registry))
    metrics_http = await start_metrics_http(metrics_registry, config.host, config.metrics_port)
    expiry = asyncio.create_task(registry.directory.expire_forever())
    await runtime.set_ready(True)
    await runtime.wait()
    expiry.cancel()
    if metrics_http is not None:
        await metrics_http[0].cleanup()
    registry.store.close()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        RegistryConfig, argv, prog="python -m registry", description="Canteen model registry"
    )
    configure_logging("registry")
    silence_protobuf_trim()  # canteen/malloc.py
    tls = config.load_tls("registry")
    try:
        asyncio.run(serve(config, tls))
    except (InvalidModelError, ValueError) as exc:
        get_logger("registry").error("bad configuration", error=str(exc))
        sys.exit(2)
    sys.exit(0)


if __name__ == "__main__":
    main()
