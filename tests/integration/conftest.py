"""The real four services on loopback with the tiny random model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2_grpc, scheduler_pb2_grpc
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, wait_serving

NUM_KV_BLOCKS = 96
BLOCK_SIZE = 8


class TinySuite:
    def __init__(
        self, suite: Suite, registry: Service, scheduler: Service, worker: Service, gateway: Service
    ) -> None:
        self.suite, self.registry, self.scheduler = suite, registry, scheduler
        self.worker, self.gateway = worker, gateway
        self.channel = grpc.insecure_channel(gateway.address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.sched_channel = grpc.insecure_channel(scheduler.address)
        self.scheduler_stub = scheduler_pb2_grpc.SchedulerStub(self.sched_channel)


@contextmanager
def tiny_suite(
    workdir: Path,
    model_dir: Path,
    num_kv_blocks: int,
    dtype: tuple[str, ...] = TRANSFORMERS_DTYPE,
    worker_args: tuple[str, ...] = (),
    scheduler_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
) -> Iterator[TinySuite]:
    """Registry, scheduler, one worker of the tiny model and a gateway, stopped on exit. The
    worker runs float32 unless ``dtype`` says otherwise (``()``: the default): the shared
    suite's tests compare its tokens with transformers' float32 forward."""
    s = Suite(workdir)
    try:
        registry = s.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={model_dir}",
            "--default-model",
            "tiny",
        )
        # No stall bound: the KV pressure test wants admission as fast as the pool allows.
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0", *scheduler_args)
        worker = s.start_worker(
            registry,
            "tiny",
            "--num-kv-blocks",
            str(num_kv_blocks),
            "--block-size",
            str(BLOCK_SIZE),
            "--threads",
            "1",
            "--max-batched-tokens",
            "256",
            *dtype,
            *worker_args,
        )
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateway = s.start_gateway(registry, scheduler, *gateway_args)
        tiny = TinySuite(s, registry, scheduler, worker, gateway)
        yield tiny
        tiny.channel.close()
        tiny.sched_channel.close()
    finally:
        codes = s.stop()
    assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="session")
def suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinySuite]:
    with tiny_suite(tmp_path_factory.mktemp("suite"), tiny_model_dir, NUM_KV_BLOCKS) as tiny:
        yield tiny
