"""One child of ``canteen up``, supervised.

A ``Supervised`` child is owned by one task (``run``): it starts the process, follows its
gRPC health (``Watch``) to know when it is ready, and when the process exits without being
asked to, starts it again after the backoff of its ``RestartPolicy``, or leaves it down. A
stop request makes the task drain the process (SIGTERM, then SIGKILL after the grace) and
return. Every change of its ``ChildState`` is reported through ``on_change``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.tls import Tls, aio_channel
from canteen.tools.up.layout import ChildSpec
from canteen.tools.up.policy import ExitLog, RestartPolicy, describe_exit
from canteen.tools.up.state import ChildState

_SERVING = health_pb2.HealthCheckResponse.SERVING


class Supervised:
    """One child's process across its restarts; see the module docstring."""

    def __init__(
        self,
        spec: ChildSpec,
        policy: RestartPolicy,
        tls: Tls | None,
        env: dict[str, str],
        on_change: Callable[[Supervised], None],
        say: Callable[[str], None],
        stop_grace: float = 40.0,
    ) -> None:
        self.spec, self.policy, self.env = spec, policy, env
        self.tls = None if spec.is_public else tls
        self.on_change, self.say, self.stop_grace = on_change, say, stop_grace
        self.state = ChildState(spec.name, spec.port, spec.metrics_port, spec.health_port)
        self.ever_ready = False
        self.process: asyncio.subprocess.Process | None = None
        self._exits = ExitLog(policy)
        self._stop = asyncio.Event()
        self._no_restart = False
        self._ready_at = 0.0  # monotonic time this run first became ready; 0: not yet

    @property
    def is_down(self) -> bool:
        """It exited too often and stays down."""
        return self.state.state == "down"

    def hold(self) -> None:
        """No more restarts: the suite is stopping (the process keeps running)."""
        self._no_restart = True

    def request_stop(self) -> None:
        """Drain the process (if any) and end ``run``."""
        self._no_restart = True
        self._stop.set()

    def _set(self, state: str, pid: int | None) -> None:
        self.state.state, self.state.pid, self.state.since = state, pid, time.time()
        self.on_change(self)

    async def run(self) -> None:
        """Until asked to stop, or until the child stays down."""
        while True:
            process = await asyncio.create_subprocess_exec(
                *self.spec.argv, env=self.env, start_new_session=True
            )
            self.process, self._ready_at = process, 0.0
            self._set("starting", process.pid)
            returncode, healthy_for, uptime = await self._watch(process)
            if returncode is None:
                return
            self.state.last_exit = describe_exit(returncode)
            if self._no_restart:
                self._set("stopped", None)
                return
            if not await self._back_off(process.pid, healthy_for, uptime):
                return
            self.state.restarts += 1

    async def _back_off(self, pid: int, healthy_for: float, uptime: float) -> bool:
        """After an unasked exit: False when the child stays down or a stop came first."""
        name, how = self.spec.name, self.state.last_exit
        delay = self._exits.record(time.monotonic(), healthy_for)
        if delay is None:
            self._set("down", None)
            self.say(
                f"canteen: {name} (pid {pid}) {how} after {uptime:.1f} s: it exited "
                f"{self.policy.max_exits} times within {self.policy.window:g} s, so it stays down"
            )
            return False
        self.say(
            f"canteen: {name} (pid {pid}) {how} after {uptime:.1f} s; starting it again in "
            f"{delay:g} s (restart {self.state.restarts + 1})"
        )
        self._set("backoff", None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)
        if self._stop.is_set() or self._no_restart:
            self._set("stopped", None)
            return False
        return True

    async def _watch(self, process: asyncio.subprocess.Process) -> tuple[int | None, float, float]:
        """Until the process exits: (its return code, seconds it was ready, seconds it ran).
        A stop request drains it first: the code is then None."""
        started = time.monotonic()
        health = asyncio.create_task(self._follow_health(process.pid))
        exited = asyncio.create_task(process.wait())
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            health.cancel()
            stop.cancel()
        if self._stop.is_set():
            await self._drain(process)
            exited.cancel()
            self._set("stopped", None)
            return None, 0.0, 0.0
        now = time.monotonic()
        healthy_for = now - self._ready_at if self._ready_at else 0.0
        return exited.result(), healthy_for, now - started

    async def _drain(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM, the grace to drain, then SIGKILL."""
        if process.returncode is not None:
            return
        self._set("stopping", process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_grace)
        except TimeoutError:
            process.kill()
            await process.wait()
        self.state.last_exit = describe_exit(process.returncode or 0)

    async def _follow_health(self, pid: int) -> None:
        """Follows readiness (Health/Watch of the child's service) while the process runs.
        A child sharing its gRPC port with siblings is asked on its own health port: on
        the shared one the kernel may hand the call to a sibling."""
        port = self.spec.health_port if self.spec.health_port >= 0 else self.spec.port
        address = f"127.0.0.1:{port}"
        async with aio_channel(address, self.tls, self.spec.role) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=self.spec.service)
            while True:
                try:
                    async for reply in stub.Watch(request, wait_for_ready=True):
                        self._on_health(reply.status == _SERVING, pid)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)  # not listening yet, or restarting its server

    def _on_health(self, is_serving: bool, pid: int) -> None:
        if is_serving and not self._ready_at:
            self._ready_at = time.monotonic()
            if self.state.restarts:
                self.say(
                    f"canteen: {self.spec.name} is ready again (pid {pid}, "
                    f"restart {self.state.restarts})"
                )
            self.ever_ready = True
        state = "ready" if is_serving else ("not-ready" if self._ready_at else "starting")
        if state != self.state.state:
            self._set(state, pid)
