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

from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc

FAULT_KINDS = (
    "kill-worker",
    "restart-worker",
    "drain-gateway",
    "restart-gateway",
    "restart-scheduler",
)
_NO_TARGET = ("restart-scheduler",)


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


async def worker_stats(scheduler: str) -> list[scheduler_pb2.WorkerStats]:
    """The scheduler's ``GetStats`` workers; [] when it does not answer."""
    async with grpc.aio.insecure_channel(scheduler) as channel:
        try:
            reply = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=2
            )
        except grpc.aio.AioRpcError:
            return []
    return list(reply.workers)


async def ready_workers(scheduler: str) -> set[str]:
    return {w.worker_id for w in await worker_stats(scheduler) if w.is_ready}


async def _serving(address: str, service: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def recovered(fault: Fault, scheduler: str, before: set[str], timeout: float) -> None:
    """Waits until what ``fault`` restarted serves again; ``before``: the workers the
    scheduler had ready when the fault fired."""

    async def has(want: set[str]) -> bool:
        return want <= await ready_workers(scheduler)

    if fault.kind == "restart-worker":
        want = before | {fault.target}
        await until(lambda: has(want), timeout, f"worker {fault.target} ready")
    elif fault.kind == "restart-scheduler":
        await until(lambda: has(before), timeout, f"a scheduler with {sorted(before)} ready")
    elif fault.kind == "restart-gateway":
        target = fault.target
        await until(
            lambda: _serving(target, "canteen.v1.Inference"), timeout, f"gateway {target} SERVING"
        )


async def inject_all(
    injector: FaultInjector,
    faults: list[Fault],
    scheduler: str,
    ready_timeout: float,
    load: LoadView,
) -> list[FaultRecord]:
    """Fault k fires when ``load.due[k]`` is set; ``load.done[k]`` is set when it is over.
    A failure is recorded and the run goes on."""
    records = []
    for k, fault in enumerate(faults):
        await load.due[k].wait()
        before, started = await ready_workers(scheduler), time.monotonic()
        record = FaultRecord(fault.kind, fault.target, started - load.t0, 0.0, load.in_flight)
        try:
            await asyncio.to_thread(inject, injector, fault)
            await recovered(fault, scheduler, before, ready_timeout)
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
