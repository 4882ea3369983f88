"""Drives a benchmark: keeps N requests in flight, or sends Poisson arrivals at a rate.

Every run is bounded twice: by ``num_requests`` and by ``duration`` seconds, after which
nothing new is sent and the requests in flight get ``drain_timeout`` seconds to finish;
the ones still running are cancelled and recorded as ``CANCELLED``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from canteen.tools.bench.clients import Client, Target, open_client
from canteen.tools.bench.records import RequestRecord, RequestSpec
from canteen.tools.bench.server_stats import Speculation
from canteen.tools.bench.stats import RunSummary, Slo, summarize
from canteen.tools.bench.workload import Workload


@dataclass(frozen=True)
class Concurrency:
    """Closed loop: ``level`` requests in flight at all times."""

    level: int

    def __post_init__(self) -> None:
        if self.level < 1:
            raise ValueError(f"concurrency={self.level}: must be >= 1")

    @property
    def label(self) -> str:
        return f"concurrency {self.level}"


@dataclass(frozen=True)
class Rate:
    """Open loop: Poisson arrivals at ``qps`` requests per second."""

    qps: float
    seed: int = 0
    """Seed of the inter-arrival gaps."""

    def __post_init__(self) -> None:
        if not self.qps > 0:
            raise ValueError(f"rate={self.qps}: must be > 0")

    @property
    def label(self) -> str:
        return f"rate {self.qps:g} req/s"


Mode = Concurrency | Rate


@dataclass(frozen=True)
class Limits:
    """Bounds and options shared by every run."""

    num_requests: int = 64
    """Most requests to send (per level in a sweep)."""
    duration: float = 600.0
    """Seconds after which no new request is sent."""
    drain_timeout: float = 60.0
    """Seconds the requests in flight get to finish once sending stops."""
    slo: Slo = field(default_factory=Slo)
    """SLOs for goodput."""
    progress: bool = True
    """Show a tqdm bar on stderr."""

    def __post_init__(self) -> None:
        for name in ("num_requests", "duration", "drain_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")


@dataclass
class BenchRun:
    """One run (one level of a sweep): its mode, every request, and the summary."""

    mode: Mode
    records: list[RequestRecord]
    duration: float
    slo: Slo
    summary: RunSummary
    speculation: Speculation | None = None  # what the service counted (--status-url)

    @property
    def concurrency(self) -> int | None:
        return self.mode.level if isinstance(self.mode, Concurrency) else None


def poisson_gaps(qps: float, num: int, seed: int) -> list[float]:
    """Exponential inter-arrival gaps with mean 1/qps, from a seeded generator."""
    if not qps > 0:
        raise ValueError(f"rate={qps}: must be > 0")
    rng = np.random.default_rng(seed)
    return [float(g) for g in rng.exponential(1.0 / qps, size=num)]


class _Slots:
    """Concurrency gate: a request is sent when one in flight finishes."""

    def __init__(self, level: int) -> None:
        self._free = asyncio.Semaphore(level)

    async def wait(self, deadline: float) -> bool:
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        if not self._free.locked():
            await self._free.acquire()  # a free slot: returns at once, no task as wait_for makes
            return True
        try:
            await asyncio.wait_for(self._free.acquire(), timeout=left)
        except TimeoutError:
            return False
        return True

    def release(self) -> None:
        self._free.release()


class _Arrivals:
    """Rate gate: sleeps to the next arrival; arrivals are absolute, so no drift."""

    def __init__(self, gaps: Sequence[float]) -> None:
        self._gaps = iter(gaps)
        self._next = time.perf_counter()

    async def wait(self, deadline: float) -> bool:
        self._next += next(self._gaps)
        if self._next >= deadline:
            return False
        await asyncio.sleep(max(0.0, self._next - time.perf_counter()))
        return True

    def release(self) -> None:
        pass


async def _send(client: Client, spec: RequestSpec, record: RequestRecord, t0: float) -> None:
    try:
        await client.send(spec, record, t0)
    except Exception as exc:  # one broken request must not end the run
        record.error, record.detail = type(exc).__name__, str(exc)[:200]


async def run_with(
    client: Client, workload: Workload, mode: Mode, limits: Limits = Limits()
) -> BenchRun:
    """One run on an open client."""
    specs = workload.take(limits.num_requests)
    gate: _Slots | _Arrivals = (
        _Slots(mode.level)
        if isinstance(mode, Concurrency)
        else _Arrivals(poisson_gaps(mode.qps, len(specs), mode.seed))
    )
    bar = tqdm(
        total=len(specs), desc=mode.label, unit="req", file=sys.stderr, disable=not limits.progress
    )
    records: list[RequestRecord] = []
    in_flight: set[asyncio.Task[None]] = set()

    def done(task: asyncio.Task[None]) -> None:
        in_flight.discard(task)
        gate.release()
        bar.update(1)

    t0 = time.perf_counter()
    deadline = t0 + limits.duration
    for index, spec in enumerate(specs):
        if not await gate.wait(deadline):
            break
        record = RequestRecord(index, spec.max_tokens, spec.prompt_len)
        records.append(record)
        task = asyncio.create_task(_send(client, spec, record, t0))
        in_flight.add(task)
        task.add_done_callback(done)
    await _drain(in_flight, limits.drain_timeout)
    duration = time.perf_counter() - t0
    bar.close()
    for record in records:
        if record.e2e is None and record.error is None:
            record.error = "CANCELLED"
    return BenchRun(mode, records, duration, limits.slo, summarize(records, duration, limits.slo))


async def _drain(in_flight: set[asyncio.Task[None]], timeout: float) -> None:
    if not in_flight:
        return
    _, pending = await asyncio.wait(set(in_flight), timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def run_bench(
    target: Target, workload: Workload, mode: Mode, limits: Limits = Limits()
) -> BenchRun:
    """Runs one benchmark against ``target``."""
    async with open_client(target) as client:
        return await run_with(client, workload, mode, limits)


async def run_sweep(
    target: Target, workload: Workload, levels: Sequence[int], limits: Limits = Limits()
) -> list[BenchRun]:
    """The concurrency mode at each level in turn, on one connection, same requests each."""
    async with open_client(target) as client:
        return [await run_with(client, workload, Concurrency(n), limits) for n in levels]
