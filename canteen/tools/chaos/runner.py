"""The load: references first, then the plan's requests paced and gated by the faults; and the
check that no KV block leaked."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from canteen.tls import Tls
from canteen.tools.chaos.faults import Fault, FaultInjector, Links, inject_all, until, worker_stats
from canteen.tools.chaos.report import RETRYABLE, Outcome, Received, Report, classify
from canteen.v1 import common_pb2, inference_pb2, inference_pb2_grpc

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Canteen batches requests on the fly",
    "Story number 4 begins on a quiet morning",
    "你好，世界。",
    "A long tale that nobody will see the end of",
    "The capital of Italy is Rome and",
)
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class ChaosError(Exception):
    """The run cannot be made (a bad plan, a failed reference); told in one line."""


@dataclass
class ChaosConfig:
    gateways: list[str]
    scheduler: str
    faults: list[Fault] = field(default_factory=list)
    requests: int = 120
    concurrency: int = 8
    max_tokens: tuple[int, ...] = (16, 32, 48, 64)
    duration: float = 30.0  # seconds the requests are paced over, faults aside
    request_timeout: float = 90.0
    attempts: int = 3  # per request, while an attempt is refused (Received.is_refused)
    retryable: tuple[str, ...] = RETRYABLE
    ready_timeout: float = 120.0  # for a restarted service to serve again
    settle: float = 10.0  # for the pools to be whole after the load
    model: str = ""
    api_key: str = ""
    tls: Tls | None = None  # the client certificate for the scheduler; None: plaintext
    supervised: bool = False  # a supervisor restarts killed and drained services

    @property
    def links(self) -> Links:
        return Links(self.scheduler, self.tls, self.supervised)

    def plan(self) -> list[tuple[int, int]]:
        """(prompt index, max_tokens) of each request: every pairing in turn."""
        n, lengths = len(PROMPTS), self.max_tokens
        return [(i % n, lengths[(i // n) % len(lengths)]) for i in range(self.requests)]

    def check(self) -> None:
        if min(self.requests, self.concurrency, self.attempts) < 1:
            raise ChaosError("requests, concurrency and attempts must be >= 1")
        part = self.requests // (len(self.faults) + 2)
        if self.faults and part <= self.concurrency:
            need = (len(self.faults) + 2) * (self.concurrency + 1)
            raise ChaosError(
                f"{self.requests} requests are too few for {len(self.faults)} faults at "
                f"concurrency {self.concurrency}: use at least {need}"
            )
        if not self.gateways or not self.max_tokens or min(self.max_tokens) < 1:
            raise ChaosError("need at least one gateway and max_tokens >= 1")


async def _generate(
    stub: inference_pb2_grpc.InferenceStub,
    request: inference_pb2.GenerateRequest,
    request_id: str,
    config: ChaosConfig,
) -> Received:
    metadata = [("x-request-id", request_id)]
    if config.api_key:
        metadata.append(("authorization", f"Bearer {config.api_key}"))
    got = Received()
    call = stub.Generate(request, metadata=tuple(metadata), timeout=config.request_timeout)
    try:
        async for msg in call:
            got.tokens.extend(msg.token_ids)
            got.finish = msg.finish_reason or got.finish
            if msg.id and msg.id != request_id:
                got.foreign_id = msg.id
    except grpc.aio.AioRpcError as exc:
        got.code, got.details = exc.code().name, exc.details() or ""
        got.answered = bool(exc.initial_metadata())
    return got


class Load:
    """The plan's requests; ``due``/``done``: one event pair per fault (see ``inject_all``)."""

    def __init__(self, config: ChaosConfig, stubs: list[inference_pb2_grpc.InferenceStub]) -> None:
        self.config, self.stubs, self.plan = config, stubs, config.plan()
        self.refs: dict[tuple[int, int], list[int]] = {}
        self.outcomes: list[Outcome] = []
        self.in_flight, self.t0 = 0, 0.0
        self.due = [asyncio.Event() for _ in config.faults]
        self.done = [asyncio.Event() for _ in config.faults]
        self.run_id = f"chaos-{uuid.uuid4().hex[:8]}"

    def request(self, key: tuple[int, int]) -> inference_pb2.GenerateRequest:
        return inference_pb2.GenerateRequest(
            model=self.config.model,
            prompt=PROMPTS[key[0]],
            max_tokens=key[1],
            temperature=0.0,
            ignore_eos=True,
        )

    async def references(self) -> None:
        """Each distinct (prompt, max_tokens) once, before any fault."""
        gate = asyncio.Semaphore(self.config.concurrency)

        async def one(key: tuple[int, int]) -> None:
            async with gate:
                rid = f"{self.run_id}-ref-{key[0]}-{key[1]}"
                got = await _generate(self.stubs[0], self.request(key), rid, self.config)
            if got.code or got.finish != common_pb2.FINISH_REASON_LENGTH:
                raise ChaosError(f"reference {rid} failed: {got.code} {got.details}")
            self.refs[key] = got.tokens

        await asyncio.gather(*(one(key) for key in sorted(set(self.plan))))

    async def one(self, i: int) -> None:
        key, started, rid = self.plan[i], time.monotonic(), f"{self.run_id}-{i:05d}"
        self.in_flight += 1
        try:
            for attempt in range(1, self.config.attempts + 1):
                stub = self.stubs[(i + attempt - 1) % len(self.stubs)]
                got = await _generate(stub, self.request(key), f"{rid}.{attempt}", self.config)
                if not got.is_refused or attempt == self.config.attempts:
                    break
                await asyncio.sleep(0.1 * 2**attempt)
        finally:
            self.in_flight -= 1
        ref = self.refs[key]
        result, detail = classify(ref, got, self.config.retryable)
        seconds = time.monotonic() - started
        self.outcomes.append(
            Outcome(
                rid,
                result,
                got.code,
                detail,
                len(got.tokens),
                attempt,
                seconds,
                got.tokens,
                got.finish,
                ref,
            )
        )

    async def run(self) -> None:
        """The plan in m+2 parts for m faults. Each part starts with a burst of
        ``concurrency`` requests, the rest paced ``duration / requests`` apart; fault k is due
        right after the burst of part k+1, and part k+2 starts once fault k is done."""
        n, m, c = len(self.plan), len(self.due), self.config.concurrency
        part, gap = max(1, n // (m + 2)), self.config.duration / max(n, 1)
        slots, tasks = asyncio.Semaphore(c), []
        self.t0 = next_at = time.monotonic()
        for i in range(n):
            k, r = divmod(i, part)
            if r == 0 and 2 <= k <= m + 1:
                await self.done[k - 2].wait()
            if r == 0:
                next_at = time.monotonic()
            if r == c and 1 <= k <= m:
                self.due[k - 1].set()
            if r >= c:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at += gap
            await slots.acquire()
            task = asyncio.create_task(self.one(i))
            task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
        await asyncio.gather(*tasks)


async def _leaks(links: Links, settle: float) -> list[str]:
    """What still holds blocks or work ``settle`` seconds after the load; [] when nothing."""
    problems: list[str] = []

    async def clean() -> bool:
        workers = await worker_stats(links)
        problems[:] = [
            f"{w.worker_id}: {w.num_free_blocks}/{w.num_total_blocks} blocks free, "
            f"{w.num_running} running, {w.num_waiting} waiting"
            for w in workers
            if (w.num_free_blocks, w.num_running, w.num_waiting) != (w.num_total_blocks, 0, 0)
        ] or ([] if workers else ["GetStats lists no worker"])
        return not problems

    try:
        await until(clean, settle, "idle pools")
    except TimeoutError:
        pass
    return problems


async def run_chaos(
    config: ChaosConfig,
    injector: FaultInjector,
    restarts: Callable[[], dict[str, int]] | None = None,
) -> Report:
    """The run; ``restarts``: a supervisor's count of restarts per service, read before and
    after it (the report keeps the difference)."""
    config.check()
    t_start = time.monotonic()
    restarts_before = restarts() if restarts else {}
    channels = [grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS) for a in config.gateways]
    try:
        load = Load(config, [inference_pb2_grpc.InferenceStub(c) for c in channels])
        await load.references()
        t_refs = time.monotonic()
        faults = asyncio.create_task(
            inject_all(injector, config.faults, config.links, config.ready_timeout, load)
        )
        try:
            await load.run()
            records = await faults
        finally:
            faults.cancel()  # when the load failed: a fault waiting for its turn
        t_load = time.monotonic()
        leaks = await _leaks(config.links, config.settle)
    finally:
        for channel in channels:
            await channel.close()
    end = time.monotonic()
    times = sorted(o.seconds for o in load.outcomes if o.result == "exact") or [0.0]
    durations = {
        "total_s": end - t_start,
        "references_s": t_refs - t_start,
        "load_s": t_load - t_refs,
        "settle_s": end - t_load,
        "p50_s": times[len(times) // 2],
        "max_s": times[-1],
    }
    after = restarts() if restarts else {}
    restarted = {k: n - restarts_before.get(k, 0) for k, n in after.items()}
    report = Report(len(load.plan), records, load.outcomes, leaks, durations)
    report.restarts = {k: n for k, n in restarted.items() if n}
    return report
