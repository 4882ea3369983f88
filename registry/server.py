"""gRPC translation for canteen.v1.Registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from canteen.v1 import registry_pb2 as pb
from canteen.v1 import registry_pb2_grpc
from registry.aliases import Alias, AliasTarget, AliasTargetNotFoundError, InvalidAliasError
from registry.core import InvalidModelError, ModelTable, Registry
from registry.directory import UnknownLeaseError, WorkerEntry
from registry.store import AliasNotFoundError, ModelExistsError, ModelNotFoundError, ModelRecord

_FORMATS = {"safetensors": pb.MODEL_FORMAT_SAFETENSORS, "gguf": pb.MODEL_FORMAT_GGUF}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}


def record_to_pb(record: ModelRecord) -> pb.ModelRecord:
    return pb.ModelRecord(
        name=record.name,
        version=record.version,
        format=_FORMATS[record.format],
        path=record.path,
        sha256=record.sha256,
        max_model_len=record.max_model_len,
        created_unix=record.created_unix,
    )


def alias_to_pb(alias: Alias) -> pb.Alias:
    return pb.Alias(
        name=alias.name,
        model=alias.model,
        targets=[pb.AliasTarget(version=t.version, weight=t.weight) for t in alias.targets],
    )


def alias_from_pb(msg: pb.Alias) -> Alias:
    """An empty model means the alias's own name."""
    return Alias(
        msg.name,
        msg.model or msg.name,
        tuple(AliasTarget(t.version, t.weight) for t in msg.targets),
    )


def _entry_to_pb(entry: WorkerEntry) -> pb.WorkerEntry:
    return pb.WorkerEntry(
        worker_id=entry.worker_id, address=entry.address, model=entry.model, version=entry.version
    )


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def _model_list(self, table: ModelTable) -> pb.ListModelsRegistryResponse:
        return pb.ListModelsRegistryResponse(
            models=[record_to_pb(r) for r in table.models],
            default_model=self._registry.default_model,
            aliases=[alias_to_pb(a) for a in table.aliases],
        )

    async def AddModel(
        self, request: pb.AddModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelRecord:
        m = request.model
        record = ModelRecord(
            m.name, m.version, _FORMAT_NAMES.get(m.format, ""), m.path, m.sha256, m.max_model_len
        )
        try:
            return record_to_pb(await self._registry.add_model(record))
        except InvalidModelError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ModelExistsError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        raise AssertionError("unreachable")

    async def GetModel(
        self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelRecord:
        try:
            return record_to_pb(self._registry.store.get(request.name, request.version))
        except ModelNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        raise AssertionError("unreachable")

    async def ListModels(
        self, request: pb.ListModelsRegistryRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsRegistryResponse:
        return self._model_list(self._registry.table())

    async def WatchModels(
        self, request: pb.WatchModelsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListModelsRegistryResponse]:
        async for table in self._registry.watch_models():
            yield self._model_list(table)

    async def SetAlias(
        self, request: pb.SetAliasRequest, context: grpc.aio.ServicerContext
    ) -> pb.Alias:
        try:
            return alias_to_pb(await self._registry.set_alias(alias_from_pb(request.alias)))
        except InvalidAliasError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except AliasTargetNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        raise AssertionError("unreachable")

    async def DeleteAlias(
        self, request: pb.DeleteAliasRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteAliasResponse:
        try:
            await self._registry.delete_alias(request.name)
        except AliasNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return pb.DeleteAliasResponse()

    async def RegisterWorker(
        self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.Lease:
        if not request.worker_id or not request.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required"
            )
        await self._registry.directory.register(
            WorkerEntry(request.worker_id, request.address, request.model, request.version)
        )
        return pb.Lease(
            worker_id=request.worker_id, ttl_seconds=self._registry.directory.ttl_seconds
        )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.Lease:
        try:
            await self._registry.directory.heartbeat(request.worker_id)
        except UnknownLeaseError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return pb.Lease(
            worker_id=request.worker_id, ttl_seconds=self._registry.directory.ttl_seconds
        )

    async def DeregisterWorker(
        self, request: pb.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterWorkerResponse:
        await self._registry.directory.deregister(request.worker_id)
        return pb.DeregisterWorkerResponse()

    async def WatchWorkers(
        self, request: pb.WatchWorkersRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WorkerList]:
        async for workers in self._registry.directory.watch():
            yield pb.WorkerList(workers=[_entry_to_pb(w) for w in workers])
