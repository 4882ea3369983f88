"""The faults: their schedule syntax, the injector interface, a shell-command injector, and
the wait until what a fault restarted serves again."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.tls import Tls, aio_channel
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc

FAULT_KINDS = (
    "kill-worker",
    "restart-worker",
    "drain-gateway",
    "restart-gateway",
    "restart-scheduler",
)
_NO_TARGET = ("restart-scheduler",)
GATEWAY_KINDS = ("drain-gateway", "restart-gateway")


@dataclass(frozen=True)
class Fault:
    """``target``: a worker id for workers, a gateway's address for gateways, none else."""

    kind: str
    target: str = ""


@dataclass
class FaultRecord:
    kind: str
    target: str
    at: float  # seconds since the load started
    seconds: float  # the fault and the wait for recovery
    in_flight: int  # requests under way when it fired
    error: str = ""


def parse_faults(text: str) -> list[Fault]:
    """``kill-worker:worker-0,restart-scheduler`` to faults; the target follows the first
    colon, so ``drain-gateway:127.0.0.1:50051`` works. argparse reports the error."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, target = item.partition(":")
        if kind not in FAULT_KINDS:
            raise argparse.ArgumentTypeError(f"{kind!r}: the kinds are {', '.join(FAULT_KINDS)}")
        if not target and kind not in _NO_TARGET:
            raise argparse.ArgumentTypeError(f"{item!r}: use {kind}:TARGET")
        faults.append(Fault(kind, target))
    return faults


class FaultInjector(Protocol):
    """Performs one fault, blocking until it is done (a drained process has exited, a
    restarted one has been started); chaos itself then waits for it to serve again."""

    def kill_worker(self, name: str) -> None: ...
    def restart_worker(self, name: str) -> None: ...
    def drain_gateway(self, address: str) -> None: ...
    def restart_gateway(self, address: str) -> None: ...
    def restart_scheduler(self) -> None: ...


def inject(injector: FaultInjector, fault: Fault) -> None:
    if fault.kind == "restart-scheduler":
        injector.restart_scheduler()
        return
    action: dict[str, Callable[[str], None]] = {
        "kill-worker": injector.kill_worker,
        "restart-worker": injector.restart_worker,
        "drain-gateway": injector.drain_gateway,
        "restart-gateway": injector.restart_gateway,
    }
    action[fault.kind](fault.target)


class ShellInjector:
    """``commands[kind]`` run by ``sh -c`` with ``{target}`` replaced by the shell-quoted
    target (also in ``$CHAOS_TARGET``); a command that exits non-zero or runs past
    ``timeout`` seconds fails the fault."""

    def __init__(self, commands: dict[str, str], timeout: float = 120.0) -> None:
        self.commands, self.timeout = commands, timeout

    def run(self, kind: str, target: str) -> None:
        command = self.commands[kind].replace("{target}", shlex.quote(target))
        env = {**os.environ, "CHAOS_TARGET": target}
        done = subprocess.run(["sh", "-c", command], env=env, timeout=self.timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{command!r} exited {done.returncode}")

    def kill_worker(self, name: str) -> None:
        self.run("kill-worker", name)

    def restart_worker(self, name: str) -> None:
        self.run("restart-worker", name)

    def drain_gateway(self, address: str) -> None:
        self.run("drain-gateway", address)

    def restart_gateway(self, address: str) -> None:
        self.run("restart-gateway", address)

    def restart_scheduler(self) -> None:
        self.run("restart-scheduler", "")


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:g} s")
        await asyncio.sleep(0.2)


@dataclass(frozen=True)
class Links:
    """Where chaos asks what recovered: the scheduler (mTLS with the client certificate, or
    plaintext when ``tls`` is None); ``supervised``: a supervisor (``canteen up``) starts a
    killed or drained service again, so those faults are over only once it serves again."""

    scheduler: str
    tls: Tls | None = None
    supervised: bool = False


async def worker_stats(links: Links) -> list[scheduler_pb2.WorkerStats]:
    """The scheduler's ``GetStats`` workers; [] when it does not answer."""
    async with aio_channel(links.scheduler, links.tls, "scheduler") as channel:
        try:
            reply = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=2
            )
        except grpc.aio.AioRpcError:
            return []
    return list(reply.workers)


async def ready_workers(links: Links) -> set[str]:
    return {w.worker_id for w in await worker_stats(links) if w.is_ready}


async def _serving(address: str, service: str) -> bool:
    """Health of a gateway: its public port, plaintext."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def recovered(fault: Fault, links: Links, before: set[str], timeout: float) -> None:
    """Waits until what ``fault`` restarted serves again; ``before``: the workers the
    scheduler had ready when the fault fired."""

    async def has(want: set[str]) -> bool:
        return want <= await ready_workers(links)

    restarts_worker = ("restart-worker", "kill-worker") if links.supervised else ("restart-worker",)
    restarts_gateway = (
        ("restart-gateway", "drain-gateway") if links.supervised else ("restart-gateway",)
    )
    if fault.kind in restarts_worker:
        want = before | {fault.target}
        await until(lambda: has(want), timeout, f"worker {fault.target} ready")
    elif fault.kind == "restart-scheduler":
        await until(lambda: has(before), timeout, f"a scheduler with {sorted(before)} ready")
    elif fault.kind in restarts_gateway:
        target = fault.target
        await until(
            lambda: _serving(target, "canteen.v1.Inference"), timeout, f"gateway {target} SERVING"
        )


async def inject_all(
    injector: FaultInjector,
    faults: list[Fault],
    links: Links,
    ready_timeout: float,
    load: LoadView,
) -> list[FaultRecord]:
    """Fault k fires when ``load.due[k]`` is set; ``load.done[k]`` is set when it is over.
    A failure is recorded and the run goes on."""
    records = []
    for k, fault in enumerate(faults):
        await load.due[k].wait()
        before, started = await ready_workers(links), time.monotonic()
        record = FaultRecord(fault.kind, fault.target, started - load.t0, 0.0, load.in_flight)
        try:
            await asyncio.to_thread(inject, injector, fault)
            await recovered(fault, links, before, ready_timeout)
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.seconds = time.monotonic() - started
        records.append(record)
        load.done[k].set()
    return records


class LoadView(Protocol):
    """What the fault runner sees of the load."""

    t0: float
    in_flight: int
    due: list[asyncio.Event]
    done: list[asyncio.Event]
