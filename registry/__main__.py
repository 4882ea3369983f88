"""``python -m registry``: the model registry and worker directory."""

from __future__ import annotations

import asyncio
import sys

from canteen.config import parse_config
from canteen.logging import configure_logging, get_logger
from canteen.metrics import new_registry, start_metrics_http
from canteen.server import ServiceRuntime
from canteen.v1 import registry_pb2, registry_pb2_grpc
from registry.config import RegistryConfig
from registry.core import InvalidModelError, Registry
from registry.directory import WorkerDirectory
from registry.metrics import RegistryCollector
from registry.server import RegistryServicer
from registry.store import ModelStore

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name


async def serve(config: RegistryConfig) -> None:
    registry = Registry(
        ModelStore(config.db), WorkerDirectory(config.lease_ttl), config.default_model
    )
    if config.register_default:
        await registry.register_default_model()
    for spec in filter(None, config.add_model.split(",")):
        await registry.add_from_spec(spec.strip())
    watches = tuple(f"/{SERVICE_NAME}/{m}" for m in ("WatchModels", "WatchWorkers"))
    runtime = ServiceRuntime(
        SERVICE_NAME, f"{config.host}:{config.port}", config.grace, untracked=watches
    )
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), runtime.server)
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
    try:
        asyncio.run(serve(config))
    except InvalidModelError as exc:
        get_logger("registry").error("bad configuration", error=str(exc))
        sys.exit(2)
    sys.exit(0)


if __name__ == "__main__":
    main()
