"""gRPC translation for canteen.v1.Worker: protobuf plans in, protobuf results out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc

from canteen.codec import plan_from_pb, result_to_pb
from canteen.local_socket import RefusedError
from canteen.logging import get_logger
from canteen.plan import StepPlan, StepResult
from canteen.v1 import worker_pb2, worker_pb2_grpc
from worker.engine.memory import PoolSize
from worker.engine.observe import SequenceSpans, StepTiming, WorkerMetrics
from worker.engine.runner import ModelRunner

log = get_logger(__name__)

_Timed = tuple[StepResult, StepTiming]


class RunRefusedError(RefusedError):
    """A Run stream the worker will not serve, with the status gRPC ends it with (the
    local socket sends the message alone)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    model: str
    version: str
    device: str
    max_batched_tokens: int


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, identity: WorkerIdentity, engine: Executor, metrics: WorkerMetrics | None = None
    ) -> None:
        self.identity = identity
        self.metrics = metrics
        self._spans = SequenceSpans()
        self.runner: ModelRunner | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_model_len = 0
        self.pool_size: PoolSize | None = None
        # The forward pass runs here (the main thread), never on the event loop.
        self._engine = engine
        self.idle = asyncio.Event()
        self.idle.set()
        self._is_running = False  # a Run stream is open
        self.run_socket = ""  # where a private socket serves Run too; "": nowhere
        self._labels: dict[str, str] = {}  # seq id -> the client's label, for logs

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        if self.runner is None or self.pool_size is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
        assert self.runner is not None and self.pool_size is not None
        i, size, loaded = self.identity, self.pool_size, self.runner.loaded
        tiers = self.runner.tiers
        return worker_pb2.WorkerInfo(
            worker_id=i.worker_id,
            model=i.model,
            version=i.version,
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            bytes_per_block=size.kv_bytes // size.num_blocks,
            kv_cache_bytes=size.kv_bytes,
            memory_budget_bytes=size.budget_bytes,
            peak_bytes_before_kv=size.peak_bytes,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            device=i.device,
            max_batched_tokens=i.max_batched_tokens,
            vocab_size=self.runner.vocab_size,
            dtype=str(loaded.dtype).removeprefix("torch."),
            dtype_reason=loaded.dtype_reason,
            quantization=loaded.quantization,
            speculative=self.runner.speculation.kind,
            num_speculative_tokens=(
                self.runner.speculation.num_tokens if self.runner.speculation.is_on else 0
            ),
            max_loras=self.runner.lora.max_loras,
            max_cpu_loras=self.runner.lora.options.max_cpu_loras,
            kv_host_bytes=tiers.host.capacity_bytes,
            kv_disk_bytes=tiers.disk.capacity_bytes if tiers.disk is not None else 0,
            kv_version=tiers.version.hex(),
            kv_disk_keys=tiers.disk_keys(),
            kv_disk_id=tiers.disk_id,
            kv_host_keys=tiers.host_keys(),
            run_socket=self.run_socket,
        )

    async def Run(
        self,
        request_iterator: AsyncIterator[worker_pb2.StepPlan],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.StepResult]:
        try:
            async for result in self.run_stream(request_iterator, context.peer()):
                yield result
        except RunRefusedError as exc:
            await context.abort(exc.code, exc.message)

    async def run_stream(
        self, plans: AsyncIterator[worker_pb2.StepPlan], peer: str
    ) -> AsyncIterator[worker_pb2.StepResult]:
        """The Run stream, whichever link carries it (gRPC, or canteen/local_socket.py)."""
        if self.runner is None:
            raise RunRefusedError(grpc.StatusCode.UNAVAILABLE, "model is still loading")
        if self._is_running:
            # One scheduler drives a worker; a second stream never replaces the first.
            log.error("second run stream refused", peer=peer)
            raise RunRefusedError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker already serves a Run stream; one scheduler drives a worker",
            )
        self._is_running = True
        runner = self.runner
        # On the engine, after any step a closed stream left queued there.
        await asyncio.get_running_loop().run_in_executor(self._engine, runner.reset)
        self.idle.clear()
        log.info("run stream opened", peer=peer)
        try:
            async for plan, result, timing in self._steps(plans):
                for failure in result.failed:
                    label = self._labels.pop(failure.seq_id, "")
                    log.error(
                        "sequence refused",
                        seq_id=failure.seq_id,
                        request_id=label,
                        error=failure.error,
                    )
                self._spans.on_result(result)
                if self.metrics is not None:
                    self.metrics.observe_step(plan, result, len(self.runner.sequences), timing)
                yield result_to_pb(result)
                if not self.runner.sequences:
                    self.idle.set()
                else:
                    self.idle.clear()
        finally:
            self._engine.submit(runner.reset)  # runs after the steps already queued
            self._labels.clear()
            self._is_running = False
            self._spans.end_all()
            self.idle.set()
            log.info("run stream closed")

    async def _steps(
        self, request_iterator: AsyncIterator[worker_pb2.StepPlan]
    ) -> AsyncIterator[tuple[StepPlan, StepResult, StepTiming]]:
        """Each plan goes to the engine as soon as it arrives; results come back in order.
        The engine runs its queue one call at a time, so with the scheduler's next plan
        already queued (--pipeline-depth) the main thread goes from one forward straight
        to the next instead of waiting for this loop to send a result and read a plan."""
        assert self.runner is not None
        runner, loop = self.runner, asyncio.get_running_loop()
        queued: asyncio.Queue[tuple[StepPlan, asyncio.Future[_Timed]] | None]
        queued = asyncio.Queue()

        def timed(plan: StepPlan, arrived: int) -> _Timed:  # on the engine thread
            began, cpu = time.perf_counter_ns(), time.thread_time_ns()
            result = runner.step(plan)
            ended = time.perf_counter_ns()
            return result, StepTiming(arrived, began, ended, time.thread_time_ns() - cpu)

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    arrived = time.perf_counter_ns()
                    plan = plan_from_pb(msg)
                    runner.prefetch_grammars(plan)  # compiles start before the plan runs
                    self._log_plan(plan)
                    self._spans.on_plan(plan)
                    runner.tiers.prefetch(plan.reload_keys)  # overlaps the steps queued before
                    step = loop.run_in_executor(self._engine, timed, plan, arrived)
                    queued.put_nowait((plan, step))
            finally:
                queued.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queued.get()) is not None:
                result, timing = await item[1]
                yield item[0], result, timing
            await reader  # the stream's own error, if it ended with one
        finally:
            reader.cancel()

    def _log_plan(self, plan: StepPlan) -> None:
        for new in plan.new_sequences:
            self._labels[new.seq_id] = new.request_id
            log.info(
                "sequence added",
                seq_id=new.seq_id,
                request_id=new.request_id,
                num_tokens=len(new.token_ids),
                num_cached=new.num_cached_tokens,
            )
        for seq_id in plan.dropped_seq_ids:
            log.info("sequence dropped", seq_id=seq_id, request_id=self._labels.pop(seq_id, ""))
