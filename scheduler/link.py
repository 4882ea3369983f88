"""One worker as the scheduler drives it: a task that owns its batch and its Run stream.

RPC handlers only ``submit`` and ``cancel``; the link's task is the single owner of the
batch state and runs the step loop: schedule, send the plan, await the result, update,
deliver events to each request's queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from canteen.batching import DEFAULT, BatchConfig
from canteen.codec import PlanEncoder, result_from_pb
from canteen.codec.fields import from_pb
from canteen.finish import Finish
from canteen.frames import FrameError
from canteen.local_socket import BrokenError
from canteen.logging import get_logger
from canteen.plan import StepPlan
from canteen.v1 import worker_pb2
from scheduler.batcher import BatchScheduler, end_unplaced
from scheduler.blocks import BlockPool
from scheduler.cost import WARMUP_STEPS
from scheduler.local_run import LocalRun, RunCall
from scheduler.sequence import Sequence
from scheduler.subscriptions import EventSink, TokenSink
from scheduler.tiers import TierIndex

log = get_logger(__name__)

StepObserver = Callable[["WorkerDescription", StepPlan, float], None]
# Sequences of a lost worker, each with the queue its caller reads, to run elsewhere.
Orphans = list[tuple[Sequence, EventSink]]
LossHandler = Callable[["WorkerLink", Orphans], None]


@dataclass(frozen=True)
class LinkSettings:
    """What the scheduler's flags set for every worker's link."""

    batch: BatchConfig = DEFAULT  # max_batched_tokens comes from each worker
    enable_prefix_cache: bool = True
    worker_timeout: float = 0.0  # a step not answered within this many seconds: worker lost


@dataclass(frozen=True)
class WorkerDescription:
    """A worker's ``WorkerInfo`` (GetInfo) as the scheduler keeps it: every field of the same
    name, read by name (canteen/codec/fields.py), plus the address it was dialled at. The
    numbers are checked against scheduler/worker_limits.py's bounds before any link."""

    worker_id: str
    address: str
    model: str
    version: str
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    max_batched_tokens: int
    vocab_size: int
    num_speculative_tokens: int = 0  # most draft tokens it verifies per sequence; 0: none
    bytes_per_block: int = 0
    kv_cache_bytes: int = 0
    memory_budget_bytes: int = 0
    peak_bytes_before_kv: int = 0
    max_loras: int = 0  # most distinct LoRA adapters in one step; 0: adapters not served
    max_cpu_loras: int = 0
    kv_host_bytes: int = 0  # its KV tiers (docs/kv-tiers.md); 0 and 0: none
    kv_disk_bytes: int = 0
    kv_version: str = ""  # the model version digest its KV blocks belong to
    kv_disk_keys: tuple[bytes, ...] = ()  # blocks of that version its disk tier held
    kv_disk_id: str = ""  # "host:/path" of its disk tier; one id, one shared index
    kv_host_keys: tuple[bytes, ...] = ()  # blocks its host tier held when it was described
    run_socket: str = ""  # its private socket (canteen/local_socket.py); "": Run over gRPC only

    @property
    def has_tiers(self) -> bool:
        return self.kv_host_bytes > 0 or self.kv_disk_bytes > 0


def describe(info: worker_pb2.WorkerInfo, address: str) -> WorkerDescription:
    return from_pb(
        info, WorkerDescription, address=address, eos_token_ids=frozenset(info.eos_token_ids)
    )


class WorkerLink:
    def __init__(
        self,
        desc: WorkerDescription,
        channel: grpc.aio.Channel,
        settings: LinkSettings,
        on_step: StepObserver | None = None,
        on_lost: LossHandler | None = None,
    ) -> None:
        self.desc = desc
        self._on_step = on_step
        self._on_lost = on_lost
        self._timeout = settings.worker_timeout or None
        self.last_batch_size = 0
        self._channel = channel
        # Worker/Run with plans written as their wire bytes (PlanEncoder reuses a decoding
        # sequence's entry from step to step), not a StepPlan message the stub serializes.
        self._run = channel.stream_stream(
            "/canteen.v1.Worker/Run",
            request_serializer=None,
            response_deserializer=worker_pb2.StepResult.FromString,
        )
        self._encode_plan = PlanEncoder()
        limits = dataclasses.replace(settings.batch, max_batched_tokens=desc.max_batched_tokens)
        pool = BlockPool(
            desc.num_blocks,
            desc.block_size,
            settings.enable_prefix_cache,
            # the version digest too: tier blocks outlive a worker, and a key names its KV
            cache_salt=f"{desc.model}:{desc.version}:{desc.kv_version}",
        )
        tiers = (
            TierIndex(desc.kv_disk_id, desc.kv_disk_keys, desc.kv_host_keys)
            if desc.has_tiers
            else None
        )
        self.core = BatchScheduler(
            pool,
            limits,
            desc.num_speculative_tokens,
            max_loras=desc.max_loras or None,
            tiers=tiers,
            cost_warmup_steps=WARMUP_STEPS,  # a fresh worker's first steps build its kernels
        )
        self._queues: dict[str, EventSink] = {}
        self._wake = asyncio.Event()
        self.is_up = True
        self.is_draining = False
        self.transport = ""  # "local" or "grpc" once the Run stream is open

    @property
    def is_ready(self) -> bool:
        return self.is_up and not self.is_draining

    def adopt(self, seq: Sequence, queue: EventSink) -> None:
        """Queues ``seq`` here; its events go to ``queue`` (new, or moved from a lost worker):
        the caller's own queue, or a subscription's sink."""
        self._queues[seq.seq_id] = queue
        self.core.add(seq, self.desc.worker_id)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        self.core.cancel(seq)
        self._queues.pop(seq.seq_id, None)
        self._wake.set()

    def drain(self) -> None:
        """Admits nothing new; closes the stream once running work is done."""
        self.is_draining = True
        self._wake.set()

    async def run(self) -> None:
        call = await self._open()
        try:
            await self._loop(call)
        except grpc.aio.AioRpcError as exc:
            self._lose(
                f"worker {self.desc.worker_id} at {self.desc.address} failed: "
                f"{exc.code().name} {exc.details()}"
            )
        except BrokenError as exc:
            self._lose(
                f"worker {self.desc.worker_id} at {self.desc.run_socket} failed: UNAVAILABLE {exc}"
            )
        except TimeoutError:
            self._lose(
                f"worker {self.desc.worker_id} did not answer a step within "
                f"{self._timeout} s (--worker-timeout)"
            )
        except Exception as exc:
            log.exception("worker link crashed", worker_id=self.desc.worker_id)
            self._lose(f"worker {self.desc.worker_id} link failed: {exc}")
        finally:
            self.is_up = False
            call.cancel()
            await self._channel.close()

    async def _open(self) -> RunCall:
        """The Run stream: on the worker's local link where it has one this scheduler can
        reach (scheduler/local_run.py), else over gRPC."""
        if self.desc.run_socket:
            try:
                run = await LocalRun.open(self.desc.run_socket, self.desc.worker_id)
            except (OSError, TimeoutError, FrameError) as exc:
                log.info("local link unreachable", worker_id=self.desc.worker_id, error=str(exc))
            else:
                self.transport = "local"
                log.info("run stream on the local link", worker_id=self.desc.worker_id)
                return run
        self.transport = "grpc"
        call: RunCall = self._run()
        return call

    async def _loop(self, call: RunCall) -> None:
        """Keeps up to ``core.depth`` plans in flight: the next plan is on the wire while the
        worker computes the current one, so the worker never waits for a round trip."""
        sent: deque[float] = deque()  # when each plan in flight was sent
        reading: asyncio.Future[object] | None = None
        last_result = time.monotonic()
        applied = False  # a result was just applied: its events wait for the next plan
        try:
            while True:
                if self.is_draining and not (self.core.running or self.core.waiting or sent):
                    log.info("worker drained", worker_id=self.desc.worker_id)
                    await call.done_writing()
                    return
                while (plan := self.core.schedule()) is not None:
                    await call.write(self._encode_plan(plan))
                    sent.append(time.monotonic())
                if self.core.preempted:
                    self._flush([self._queues.get(i) for i in self.core.preempted])
                    self.core.preempted.clear()
                if applied:
                    # The plan the result made room for is on the wire before the tokens'
                    # deliveries (the gateway's writes) run, so the worker's next step never
                    # waits for them; and handlers submit and cancel between steps.
                    applied = False
                    await asyncio.sleep(0)
                    continue  # plan what the handlers just submitted, if there is room
                if not sent:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                reading = reading or asyncio.ensure_future(call.read())
                if not await self._result_or_wake(reading, len(sent) < self.core.depth):
                    continue  # new work arrived and the pipeline has room: plan it first
                msg, reading = reading.result(), None
                last_result = self._apply(msg, max(sent.popleft(), last_result))
                applied = True
        finally:
            if reading is not None:
                reading.cancel()

    async def _result_or_wake(self, reading: asyncio.Future[object], has_room: bool) -> bool:
        """Waits for the worker's next result (True), or, while the pipeline has room, for
        new work (False). A result later than ``--worker-timeout`` raises TimeoutError.
        The result's arrival sets the wake event too: one wait, no task or ``asyncio.wait``
        per step."""
        if not has_room:
            await asyncio.wait_for(asyncio.shield(reading), self._timeout)
            return True
        if reading.done():
            return True
        self._wake.clear()
        reading.add_done_callback(self._wake_up)
        try:
            async with asyncio.timeout(self._timeout):
                await self._wake.wait()
        finally:
            reading.remove_done_callback(self._wake_up)
        return reading.done()

    def _wake_up(self, _: asyncio.Future[object]) -> None:
        self._wake.set()

    def _apply(self, msg: object, started: float) -> float:
        """Delivers one result's events; returns when it arrived."""
        if msg is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "worker closed its stream",
            )
        result = result_from_pb(msg)  # type: ignore[arg-type]
        now = time.monotonic()
        plan = self.core.oldest_in_flight
        self.last_batch_size = len(plan.scheduled)
        if self._on_step is not None:
            self._on_step(self.desc, plan, now - started)
        for event in self.core.update(result):
            queue = self._queues.get(event.seq_id)
            if queue is not None:
                queue.put_nowait(event)
                if event.finish is not None:
                    del self._queues[event.seq_id]
        return now

    @staticmethod
    def _flush(sinks: list[EventSink | None]) -> None:
        """Sequences that wait now (preempted, or orphaned) send the tokens their stream
        interval holds: a caller does not wait with them for tokens already made."""
        for sink in sinks:
            if isinstance(sink, TokenSink):
                sink.flush()

    def _lose(self, error: str) -> None:
        """The worker is gone: its sequences go to ``on_lost`` to run elsewhere (or fail)."""
        log.error("worker lost", worker_id=self.desc.worker_id, error=error)
        self.is_up = False
        orphans = [
            (seq, self._queues[seq.seq_id])
            for seq in self.core.evict_all()
            if seq.seq_id in self._queues
        ]
        self._queues.clear()
        self._flush([queue for _, queue in orphans])
        if self._on_lost is not None:
            self._on_lost(self, orphans)
            return
        for seq, queue in orphans:
            queue.put_nowait(end_unplaced(seq, Finish.FAILED, error))
