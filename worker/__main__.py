"""``python -m worker``: load a model from the registry, serve canteen.v1.Worker."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import socket
import sys
import threading
import uuid
from concurrent.futures import Executor

import grpc
import torch

from canteen.config import parse_config
from canteen.local_socket import message_server
from canteen.logging import configure_logging, get_logger
from canteen.malloc import keep_freed_memory, silence_protobuf_trim
from canteen.metrics import new_registry, start_metrics_http
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from canteen.server import ServiceRuntime
from canteen.tls import Policy, Tls, aio_channel
from canteen.tracing import configure_tracing, shutdown_tracing
from canteen.v1 import registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker.config import WorkerConfig
from worker.engine.engine import MainThreadExecutor
from worker.engine.memory import (
    Baseline,
    MemoryBudgetError,
    PoolSize,
    kv_bytes_per_block,
    measure_baseline,
    peak_bytes,
    size_pool,
)
from worker.engine.observe import WorkerMetrics
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.kv_tiers.store import open_tiers, version_digest
from worker.lora.store import LoraMetrics
from worker.model.loader import (
    LoadedModel,
    ModelLoadError,
    choose_dtype,
    choose_quantization,
    load_model,
    pick_device,
)
from worker.server import WorkerIdentity, WorkerServicer
from worker.speculation.draft import can_share_kv
from worker.speculation.speculate import SpeculationConfig

log = get_logger("worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# Only the scheduler drives the worker; operators' tools may read what it serves.
POLICY = Policy.of(Run=["scheduler"], GetInfo=["scheduler", "client"])
# Readiness waits this long for the grammar tokenizer (worker/engine/constrain.py preload)
GRAMMAR_LOAD_WAIT_S = 120.0
_FORMATS = {
    registry_pb2.MODEL_FORMAT_GGUF: "gguf",
    registry_pb2.MODEL_FORMAT_SAFETENSORS: "safetensors",
}


async def fetch_record(
    registry: registry_pb2_grpc.RegistryStub, model: str
) -> registry_pb2.ModelRecord:
    name, _, version = model.partition(":")
    delay = 0.2
    while True:
        try:
            record: registry_pb2.ModelRecord = await registry.GetModel(
                registry_pb2.GetModelRequest(name=name, version=version), timeout=5
            )
            return record
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise ModelLoadError(exc.details()) from exc
            log.info("waiting for registry", delay=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def advertised_host(config: WorkerConfig) -> str:
    """The host the scheduler dials: --advertise-host, else --host unless it is a wildcard
    (0.0.0.0 or ::), in which case this machine's hostname."""
    if config.advertise_host:
        return config.advertise_host
    return socket.gethostname() if config.host in ("0.0.0.0", "::", "") else config.host


def warm_up(runner: ModelRunner, num_tokens: int) -> None:
    """Prefills ``num_tokens`` then decodes one, so lazy init and the peak happen now."""
    seq = NewSequence(
        "warm-up",
        tuple([1] * num_tokens),
        Sampling(temperature=0.0),
        tuple(range(runner.blocks_for(num_tokens + 1))),
    )
    runner.step(StepPlan(0, (seq,), (ScheduledSequence("warm-up", num_tokens),)))
    runner.step(StepPlan(0, (), (ScheduledSequence("warm-up", 1),)))
    runner.step(StepPlan(0, dropped_seq_ids=("warm-up",)))


def load_draft(
    config: WorkerConfig,
    record: registry_pb2.ModelRecord,
    device: torch.device,
    dtype: torch.dtype,
    target: LoadedModel,
) -> LoadedModel:
    """The draft model, at the target's dtype; it must share the target's vocabulary."""
    log.info("loading draft model", model=record.name, version=record.version)
    draft = load_model(
        record.path,
        _FORMATS.get(record.format, ""),
        record.sha256,
        device,
        dtype,
        config.verify_checksum,
        quantization=config.draft_quantization,
        forward=config.forward,
    )
    vocab, target_vocab = draft.model.config.vocab_size, target.model.config.vocab_size
    if vocab != target_vocab:
        raise ModelLoadError(
            f"draft_model={config.draft_model!r}: its vocabulary has {vocab} tokens, the "
            f"target's {target_vocab}; a draft must share the target's tokenizer"
        )
    return draft


def build_runner(
    loaded: LoadedModel,
    config: WorkerConfig,
    baseline: Baseline,
    max_model_len: int,
    draft: LoadedModel | None = None,
    draft_shares_kv: bool = False,
) -> tuple[ModelRunner, PoolSize]:
    """Warms up at the largest step on a scratch pool, then sizes the real pool from the peak."""
    step_tokens = max(min(config.max_batched_tokens, max_model_len - 1), 1)
    bs = config.block_size
    # On CUDA the scratch runner captures the decode graphs too: their memory is in the peak.
    scratch_blocks = (step_tokens + 1 + bs - 1) // bs
    shape = RunnerConfig(
        scratch_blocks,
        bs,
        config.max_batched_tokens,
        graphs=config.graph_sizes,
        grammar=config.grammar,
        lora=config.lora,
        narrow_step_rows=config.narrow_step_rows,
        small_step_mmacs=config.small_step_mmacs,
        num_threads=torch.get_num_threads(),  # before any narrow step set one
    )
    scratch = ModelRunner(loaded, shape)
    warm_up(scratch, step_tokens)
    del scratch
    size = size_pool(
        baseline,
        peak_bytes(loaded.device),
        # a draft model keeps its own KV for the same block ids, unless it reads the target's
        kv_bytes_per_block(loaded, bs)
        + (kv_bytes_per_block(draft, bs) if draft and not draft_shares_kv else 0),
        memory_fraction=config.memory_fraction,
        kv_cache_bytes=config.kv_cache_bytes,
        num_blocks=config.num_kv_blocks,
    )
    speculation = SpeculationConfig(config.speculative, config.num_speculative_tokens)
    shape = dataclasses.replace(
        shape, num_blocks=size.num_blocks, speculation=speculation, draft_shares_kv=draft_shares_kv
    )
    runner = ModelRunner(loaded, shape, draft)
    warm_up(runner, min(bs * 2, size.num_blocks * bs - 1))
    return runner, size


async def keep_lease(
    registry: registry_pb2_grpc.RegistryStub, request: registry_pb2.RegisterWorkerRequest
) -> None:
    """Registers, then heartbeats; re-registers when the registry forgot the lease."""
    registered = False
    ttl = 10.0
    while True:
        try:
            if not registered:
                lease = await registry.RegisterWorker(request, timeout=5)
                registered = True
                log.info("registered", registry_ttl=lease.ttl_seconds)
            else:
                lease = await registry.Heartbeat(
                    registry_pb2.HeartbeatRequest(worker_id=request.worker_id), timeout=5
                )
            ttl = lease.ttl_seconds
        except grpc.aio.AioRpcError as exc:
            log.warning("lease renewal failed", code=exc.code().name)
            if registered and exc.code() == grpc.StatusCode.NOT_FOUND:
                registered = False  # a restarted registry forgot the lease: register now
                continue
        await asyncio.sleep(max(ttl / 3, 0.1))


async def load(
    config: WorkerConfig,
    record: registry_pb2.ModelRecord,
    engine: Executor,
    servicer: WorkerServicer,
    draft_record: registry_pb2.ModelRecord | None = None,
) -> None:
    """Loads, sizes the KV pool and warms up, all on the engine (main) thread."""
    loop = asyncio.get_running_loop()
    device = pick_device(config.device)
    baseline = measure_baseline(device)
    log.info(
        "loading model",
        model=record.name,
        version=record.version,
        path=record.path,
        device=str(device),
    )
    fmt = _FORMATS.get(record.format, "")
    quantization, why = choose_quantization(
        config.quantization, record.path, fmt, device, config.dtype
    )
    log.info("quantization", quantization=quantization, reason=why)
    dtype, reason = choose_dtype(config.dtype, device, quantization)
    log.info("dtype", dtype=str(dtype).removeprefix("torch."), reason=reason)
    loaded = await loop.run_in_executor(
        engine,
        functools.partial(
            load_model,
            record.path,
            fmt,
            record.sha256,
            device,
            dtype,
            config.verify_checksum,
            quantization=quantization,
            forward=config.forward,
            # a low-bit choice says why beside the dtype's reason (the log has both always)
            dtype_reason=reason if quantization == "none" else f"{reason}; {why}",
        ),
    )
    draft, shares_kv = None, False
    if draft_record is not None:
        draft = await loop.run_in_executor(
            engine, load_draft, config, draft_record, device, dtype, loaded
        )
        same_weights = (draft_record.path, draft_record.sha256) == (record.path, record.sha256)
        shares_kv = can_share_kv(loaded, draft, same_weights)
        log.info("draft model", shares_target_kv=shares_kv, same_weights=same_weights)
    max_model_len = min(loaded.max_model_len, record.max_model_len or loaded.max_model_len)
    runner, size = await loop.run_in_executor(
        engine, build_runner, loaded, config, baseline, max_model_len, draft, shares_kv
    )
    digest = version_digest(
        record.name,
        record.version,
        record.sha256,
        loaded.dtype,
        loaded.quantization,
        loaded.forward_name,
        config.block_size,
    )
    runner.tiers = open_tiers(
        config.kv_host_tier_bytes, config.kv_disk_dir, config.kv_disk_tier_bytes, digest
    )
    servicer.runner, servicer.pool_size = runner, size
    servicer.eos_token_ids = loaded.eos_token_ids
    servicer.max_model_len = max_model_len
    log.info(
        "ready",
        num_blocks=size.num_blocks,
        block_size=config.block_size,
        bytes_per_block=size.kv_bytes // size.num_blocks,
        kv_cache_mib=round(size.kv_bytes / 2**20, 1),
        peak_mib=round(size.peak_bytes / 2**20, 1),
        budget_mib=round(size.budget_bytes / 2**20, 1),
        eos_token_ids=list(loaded.eos_token_ids),
        forward=loaded.forward_name,
        quantization=loaded.quantization,
    )


async def serve(
    config: WorkerConfig, tls: Tls | None, engine: Executor, runtimes: list[ServiceRuntime]
) -> None:
    runtime = ServiceRuntime(
        SERVICE_NAME,
        f"{config.host}:{config.port}",
        config.grace,
        handle_signals=False,
        credentials=tls.server_credentials() if tls else None,
        policy=POLICY if tls else None,
        health_port=config.health_port,
    )
    runtimes.append(runtime)  # the main thread's signal handler drains it
    # Under mTLS the certificate names the worker (canteen/certs.py).
    worker_id = config.worker_id or (tls.worker_id if tls else "")
    worker_id = worker_id or f"worker-{uuid.uuid4().hex[:8]}"
    channel = aio_channel(config.registry, tls, "registry")
    registry = registry_pb2_grpc.RegistryStub(channel)
    record = await fetch_record(registry, config.model)
    draft = await fetch_record(registry, config.draft_model) if config.draft_model else None
    identity = WorkerIdentity(
        worker_id,
        record.name,
        record.version,
        str(pick_device(config.device)),
        config.max_batched_tokens,
    )
    metrics_registry = new_registry()
    metrics = WorkerMetrics(metrics_registry, record.name, record.version)
    servicer = WorkerServicer(identity, engine, metrics)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, runtime.server)
    port = await runtime.start([SERVICE_NAME])
    # Run on a private socket too, for a scheduler on this host and user (its hello: the id)
    local = message_server(
        "canteen-worker-",
        worker_id,
        worker_pb2.StepPlan.FromString,
        lambda plans: servicer.run_stream(plans, "unix"),
    )
    if config.local_link == "auto":
        servicer.run_socket = await local.start()
    metrics_http = await start_metrics_http(metrics_registry, config.host, config.metrics_port)
    await load(config, record, engine, servicer, draft)
    assert servicer.runner is not None
    servicer.runner.lora.observe(LoraMetrics(metrics_registry, record.name, record.version))
    assert servicer.pool_size is not None
    metrics.set_pool(servicer.pool_size.kv_bytes, servicer.pool_size.budget_bytes)
    constraints = servicer.runner.constraints
    if not await asyncio.to_thread(constraints.wait_loaded, GRAMMAR_LOAD_WAIT_S):
        log.warning("ready before the grammar tokenizer loaded", waited_s=GRAMMAR_LOAD_WAIT_S)
    await runtime.set_ready(True)
    host = advertised_host(config)
    lease = asyncio.create_task(
        keep_lease(
            registry,
            registry_pb2.RegisterWorkerRequest(
                worker_id=worker_id,
                address=f"{host}:{port}",
                model=record.name,
                version=record.version,
            ),
        )
    )

    async def drain() -> None:
        lease.cancel()
        local.stop_listening()  # the running stream goes on; no new one
        try:
            await registry.DeregisterWorker(
                registry_pb2.DeregisterWorkerRequest(worker_id=worker_id), timeout=2
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("deregister failed", code=exc.code().name)
        # The scheduler stops admitting here and lets running sequences finish.
        try:
            await asyncio.wait_for(servicer.idle.wait(), timeout=config.grace)
        except TimeoutError:
            log.warning("drain grace expired with sequences running")

    runtime.on_drain(drain)
    await runtime.wait()
    local.close()
    await asyncio.to_thread(servicer.runner.tiers.close)  # the disk writes queued so far
    await channel.close()
    if metrics_http is not None:
        await metrics_http[0].cleanup()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        WorkerConfig, argv, prog="python -m worker", description="Canteen model worker"
    )
    configure_logging("worker")
    keep_freed_memory()  # canteen/malloc.py: before the model loads
    silence_protobuf_trim()
    tls = config.load_tls("worker", config.worker_id)
    configure_tracing("canteen-worker", config.otlp_endpoint, tls)
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = MainThreadExecutor()
    runtimes: list[ServiceRuntime] = []
    exit_code = [0]

    def run_loop() -> None:
        try:
            asyncio.run(serve(config, tls, engine, runtimes))
        except (ModelLoadError, MemoryBudgetError) as exc:
            log.error("cannot load model", error=str(exc))
            exit_code[0] = 2
        except BaseException:
            log.exception("worker failed")
            exit_code[0] = 1
        finally:
            engine.shutdown()

    # gRPC runs beside; torch runs here, on the main thread (see worker/engine/engine.py).
    grpc_thread = threading.Thread(target=run_loop, name="grpc-loop", daemon=True)

    def on_signal(signum: int, _frame: object) -> None:
        if not runtimes:
            sys.exit(0)  # not serving yet: nothing to drain
        runtimes[0].drain_threadsafe(signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    grpc_thread.start()
    engine.run_forever()
    grpc_thread.join()
    shutdown_tracing()
    sys.exit(exit_code[0])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
