"""gRPC translation for canteen.v1.Registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from canteen.admin_keys import WRITE, AdminKeys, AuthenticationError, ScopeError
from canteen.auth import ApiKeys
from canteen.tls import peer_identity
from canteen.v1 import registry_pb2 as pb
from canteen.v1 import registry_pb2_grpc
from registry.aliases import AliasTargetNotFoundError, InvalidAliasError
from registry.codec import (
    alias_from_pb,
    alias_to_pb,
    entry_from_pb,
    entry_to_pb,
    record_from_pb,
    record_to_pb,
)
from registry.core import InvalidModelError, ModelInUseError, ModelTable, Registry
from registry.directory import NotLeaseOwnerError, UnknownLeaseError
from registry.store import AliasNotFoundError, ModelExistsError, ModelNotFoundError


def _owner(context: grpc.aio.ServicerContext) -> str | None:
    """The worker id the caller's certificate names; None on a plaintext link."""
    peer = peer_identity(context)
    return None if peer is None else peer.worker_id


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, registry: Registry, admin_keys: AdminKeys | ApiKeys | None = None) -> None:
        self._registry = registry
        if not isinstance(admin_keys, AdminKeys):
            admin_keys = AdminKeys.all_write(admin_keys or ApiKeys([]))
        self._admin_keys = admin_keys

    async def _require_admin(self, context: grpc.aio.ServicerContext, action: str) -> None:
        """Writes need an admin key of scope write (``authorization: Bearer KEY``)."""
        if not self._admin_keys.is_enabled:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "registry writes are disabled: start the registry with --admin-keys-file",
            )
        authorization = dict(context.invocation_metadata() or ()).get("authorization")
        try:
            self._admin_keys.authorize(str(authorization) if authorization else None, action, WRITE)
        except AuthenticationError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"admin key: {exc.reason}")
        except ScopeError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))

    def _model_list(self, table: ModelTable) -> pb.ListModelsRegistryResponse:
        return pb.ListModelsRegistryResponse(
            models=[record_to_pb(r) for r in table.models],
            default_model=self._registry.default_model,
            aliases=[alias_to_pb(a) for a in table.aliases],
        )

    async def AddModel(
        self, request: pb.AddModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelRecord:
        await self._require_admin(context, "AddModel")
        if not self._registry.model_roots:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "AddModel is disabled: start the registry with --model-root FOLDER",
            )
        record = record_from_pb(request.model)
        try:
            return record_to_pb(await self._registry.add_model(record))
        except InvalidModelError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ModelExistsError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        raise AssertionError("unreachable")

    async def DeleteModel(
        self, request: pb.DeleteModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteModelResponse:
        await self._require_admin(context, "DeleteModel")
        try:
            await self._registry.delete_model(request.name, request.version)
        except InvalidModelError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ModelNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except ModelInUseError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.DeleteModelResponse()

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
        await self._require_admin(context, "SetAlias")
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
        await self._require_admin(context, "DeleteAlias")
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
        try:
            await self._registry.directory.register(
                entry_from_pb(request),
                _owner(context),
            )
        except NotLeaseOwnerError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.Lease(
            worker_id=request.worker_id, ttl_seconds=self._registry.directory.ttl_seconds
        )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.Lease:
        try:
            await self._registry.directory.heartbeat(request.worker_id, _owner(context))
        except UnknownLeaseError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except NotLeaseOwnerError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.Lease(
            worker_id=request.worker_id, ttl_seconds=self._registry.directory.ttl_seconds
        )

    async def DeregisterWorker(
        self, request: pb.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterWorkerResponse:
        try:
            await self._registry.directory.deregister(request.worker_id, owner=_owner(context))
        except NotLeaseOwnerError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return pb.DeregisterWorkerResponse()

    async def WatchWorkers(
        self, request: pb.WatchWorkersRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WorkerList]:
        async for workers in self._registry.directory.watch():
            yield pb.WorkerList(workers=[entry_to_pb(w) for w in workers])
