"""Server bootstrap shared by the four services: health, reflection, draining, signals.

Health follows DESIGN.md: service ``""`` is liveness (SERVING while the process runs), the
service's full name is readiness (NOT_SERVING until the service says it is ready, and again
from the moment a drain starts). While draining, new RPCs other than health and reflection are
refused with UNAVAILABLE; in-flight RPCs get ``grace_seconds`` to finish.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from canteen.heap import freeze_startup_heap
from canteen.logging import get_logger
from canteen.tls import Policy, peer_role

log = get_logger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_ALWAYS_ALLOWED = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_LAST_REFUSALS_SECONDS = 0.2


class _DrainInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts in-flight work and refuses new work with UNAVAILABLE once draining."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self._runtime = runtime

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if method.startswith(_ALWAYS_ALLOWED):
            return handler
        policy = self._runtime.policy
        gate = _Gate(method, policy) if policy is not None else None
        if method in self._runtime.untracked:
            return _counted(handler, None, gate)
        if self._runtime.is_draining:
            return _unavailable_handler(handler)
        return _counted(handler, self._runtime.in_flight, gate)


class _Gate:
    """Refuses a caller whose certificate's role may not call the method."""

    def __init__(self, method: str, policy: Policy) -> None:
        self.method, self.policy = method, policy

    async def check(self, context: grpc.aio.ServicerContext) -> None:
        role = peer_role(context)
        refusal = self.policy.refusal(self.method, role)
        if refusal is not None:
            log.warning("caller refused", method=self.method, role=role, peer=context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)


class _InFlight:
    """How many tracked RPCs are running; ``idle`` is set when none are."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.count += 1
        self.idle.clear()

    def exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()


class _Undecodable:
    """What a request that is not a valid message decodes to, so the handler can refuse it
    with INVALID_ARGUMENT (an exception in the deserializer would surface as UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(exc)

    return decode


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid protobuf message: {request.error}",
        )


def _counted(
    handler: grpc.RpcMethodHandler, in_flight: _InFlight | None, gate: _Gate | None
) -> grpc.RpcMethodHandler:
    """Wraps a handler: refuses undecodable requests and callers the gate turns away, and
    counts the call in ``in_flight`` (None: a watch stream a drain does not wait for)."""
    if handler is None:
        return handler
    des, ser = handler.request_deserializer, handler.response_serializer
    if not handler.request_streaming:
        des = _safe(des)

    async def admit(request: Any, context: grpc.aio.ServicerContext) -> None:
        await _refuse_undecodable(request, context)
        if gate is not None:
            await gate.check(context)
        if in_flight is not None:
            in_flight.enter()

    def leave() -> None:
        if in_flight is not None:
            in_flight.exit()

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(request, context)
            try:
                return await inner_uu(request, context)
            finally:
                leave()

        return grpc.unary_unary_rpc_method_handler(unary_unary, des, ser)
    streaming = handler.unary_stream or handler.stream_stream
    if streaming is not None:
        # One wrapper serves both: the first argument is a request or a request iterator.
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(request, context)
            try:
                async for item in streaming(request, context):
                    yield item
            finally:
                leave()

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(stream, des, ser)
        return grpc.stream_stream_rpc_method_handler(stream, des, ser)
    return handler


def _unavailable_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry elsewhere")

    if handler is None:
        return handler
    if handler.response_streaming and handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ServiceRuntime:
    """One gRPC server with health, reflection and a drain on SIGTERM or SIGINT."""

    def __init__(
        self,
        service_name: str,
        address: str,
        grace_seconds: float = 10.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        untracked: tuple[str, ...] = (),
        handle_signals: bool = True,
        credentials: grpc.ServerCredentials | None = None,
        policy: Policy | None = None,
        health_port: int = -1,
        reuse_port: bool = False,
    ) -> None:
        self.service_name = service_name
        # TLS on the main port (None: plaintext), and who may call what (None: anyone).
        self.credentials = credentials
        self.policy = policy
        self.health_port = health_port
        self._health_server: grpc.aio.Server | None = None
        # Long-lived watch streams that a drain does not wait for.
        self.untracked = untracked
        self.in_flight = _InFlight()
        self._handle_signals = handle_signals
        self._loop: asyncio.AbstractEventLoop | None = None
        self.address = address
        self.grace_seconds = grace_seconds
        self.is_draining = False
        self._stopped = asyncio.Event()
        self._on_drain: list[Callable[[], Awaitable[None]]] = []
        self.server = grpc.aio.server(
            interceptors=[_DrainInterceptor(self)],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # 1: sibling processes share the port (several gateways); 0: a second
                # process on a taken port fails to start instead of splitting the traffic.
                ("grpc.so_reuseport", int(reuse_port)),
                # Notice a peer that vanished without closing (a dead host): its streams end,
                # so a restarted scheduler's Run stream is not refused for a ghost.
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 10_000),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    def on_drain(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Runs ``callback`` after readiness flips and before the server stops."""
        self._on_drain.append(callback)

    async def set_ready(self, is_ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_ready and not self.is_draining
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(self.service_name, status)
        if is_ready:
            # what start-up built lives as long as the process: no full collection walks it
            freeze_startup_heap()

    async def start(self, reflected_services: Iterable[str]) -> int:
        names = [
            *reflected_services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        if self.credentials is not None:
            self.port = self.server.add_secure_port(self.address, self.credentials)
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"could not bind {self.address}")
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        await self._start_health_port()
        self._loop = asyncio.get_running_loop()
        if self._handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        log.info("listening", address=self.address, port=self.port, service=self.service_name)
        return self.port

    async def _start_health_port(self) -> None:
        """Plaintext health only, for probes without a client certificate (kubelet, compose)."""
        if self.health_port < 0:
            return
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        host = self.address.rpartition(":")[0]
        port = self._health_server.add_insecure_port(f"{host}:{self.health_port}")
        if port == 0:
            raise RuntimeError(f"could not bind the health port {host}:{self.health_port}")
        self.health_port = port
        await self._health_server.start()
        log.info("health port listening", port=port)

    def _on_signal(self, sig: signal.Signals) -> None:
        self._drain_task = asyncio.ensure_future(self.drain(sig.name))

    def drain_threadsafe(self, sig: signal.Signals) -> None:
        """Starts a drain from another thread (a signal handler on the main thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_signal, sig)

    async def drain(self, reason: str = "requested") -> None:
        if self.is_draining:
            return
        log.info("draining", reason=reason, grace_seconds=self.grace_seconds)
        self.is_draining = True
        await self.health.set(self.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for callback in self._on_drain:
            try:
                await callback()
            except Exception:  # a failing hook must not block the exit
                log.exception("drain hook failed")
        # The server keeps answering (health, UNAVAILABLE for new work) while in-flight
        # RPCs finish; only then does it stop listening.
        try:
            await asyncio.wait_for(self.in_flight.idle.wait(), self.grace_seconds)
        except TimeoutError:
            log.warning("grace period over; cancelling", num_in_flight=self.in_flight.count)
        # Calls already on the wire still get UNAVAILABLE (retryable) rather than the
        # CANCELLED that a stopping server answers.
        await asyncio.sleep(_LAST_REFUSALS_SECONDS)
        await self.server.stop(0.5)
        if self._health_server is not None:
            await self._health_server.stop(0)
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
        log.info("stopped")
