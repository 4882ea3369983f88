"""Scheduler and registry restarts for real (SIGKILL, then the same port again): requests
without a token yet wait and succeed, streams with tokens end UNAVAILABLE without repeats,
and a restarted registry keeps every model while workers re-register on their own."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.v1 import (
    registry_pb2,
    registry_pb2_grpc,
)
from tests.support.stack import worker_stats
from tests.support.streams import Stream, generate, until
from tests.support.suite import ADMIN_KEY, Service, Suite, wait_serving

WORKER_ARGS = ("--num-kv-blocks", "128", "--block-size", "8", "--threads", "1")


@dataclass
class Stack:
    suite: Suite
    registry: Service
    scheduler: Service
    worker: Service
    gateway: Service
    model_dir: Path


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Suite(tmp_path_factory.mktemp("restarts"))
    try:
        registry = s.start_tiny_registry(tiny_model_dir, "--lease-ttl", "3")
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0")
        worker = s.start_worker(registry, "tiny", *WORKER_ARGS)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateway = s.start_gateway(registry, scheduler, "--scheduler-retry", "30")
        yield Stack(s, registry, scheduler, worker, gateway, tiny_model_dir)
    finally:
        s.stop()


def _serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _kill(svc: Service) -> None:
    svc.process.send_signal(signal.SIGKILL)
    svc.process.wait(10)


def test_a_request_sent_while_the_scheduler_is_down_waits_and_succeeds(stack: Stack) -> None:
    prompt = "Restart me gently"
    expected = generate(stack.gateway.address, prompt, 24)
    _kill(stack.scheduler)
    until(lambda: not _serving(stack.gateway.address, "canteen.v1.Inference"), 10, "NOT_SERVING")
    stream = Stream(stack.gateway.address, prompt, 24)
    stream.start()
    time.sleep(1.0)
    assert stream.is_alive() and stream.error is None  # waiting for a scheduler, not failed
    stack.scheduler = stack.suite.restart(stack.scheduler, wait_ready=False)
    stream.join(60)
    assert stream.error is None, stream.error
    assert stream.tokens == expected
    until(lambda: _serving(stack.gateway.address, "canteen.v1.Inference"), 30, "SERVING again")


def test_a_stream_with_tokens_ends_unavailable_and_repeats_nothing(stack: Stack) -> None:
    prompt = "A long tale that the scheduler will not see the end of"
    expected = generate(stack.gateway.address, prompt, 600)
    stream = Stream(stack.gateway.address, prompt, 600)
    stream.start()
    until(lambda: len(stream.tokens) >= 8, 60, "tokens to flow")
    _kill(stack.scheduler)
    stream.join(60)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert 8 <= len(stream.tokens) < 600
    assert stream.tokens == expected[: len(stream.tokens)]  # a prefix: nothing repeated
    stack.scheduler = stack.suite.restart(stack.scheduler, wait_ready=False)
    wait_serving(stack.scheduler.address, "canteen.v1.Scheduler", 60)
    assert generate(stack.gateway.address, prompt, 600) == expected


def test_a_registry_restart_keeps_every_model_and_workers_come_back(stack: Stack) -> None:
    with grpc.insecure_channel(stack.registry.address) as channel:
        registry_pb2_grpc.RegistryStub(channel).AddModel(
            registry_pb2.AddModelRequest(
                model=registry_pb2.ModelRecord(
                    name="spare", version="v1", path=str(stack.model_dir)
                )
            ),
            timeout=30,
            metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
        )
    _kill(stack.registry)
    # The data path does not need the registry: requests go on while it is down.
    assert len(generate(stack.gateway.address, "no registry", 5)) == 5
    stack.registry = stack.suite.restart(stack.registry)
    with grpc.insecure_channel(stack.registry.address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        listed = stub.ListModels(registry_pb2.ListModelsRegistryRequest(), timeout=5)
        assert {(m.name, m.version) for m in listed.models} >= {("tiny", "v1"), ("spare", "v1")}

        def worker_registered() -> bool:
            workers = stub.WatchWorkers(registry_pb2.WatchWorkersRequest(), timeout=2)
            return any(w.worker_id == "worker" for w in next(iter(workers)).workers)

        until(worker_registered, 20, "the worker to re-register")
    # The scheduler kept its link through the registry's absence.
    stats = worker_stats(stack.scheduler.address)
    assert [wid for wid, w in stats.items() if w.is_ready] == ["worker"]
    assert len(generate(stack.gateway.address, "registry is back", 5)) == 5


def test_registry_sigterm_under_load_exits_0_and_streams_go_on(stack: Stack) -> None:
    prompt = "The registry steps away"
    expected = generate(stack.gateway.address, prompt, 300)
    stream = Stream(stack.gateway.address, prompt, 300)
    stream.start()
    until(lambda: len(stream.tokens) >= 4, 60, "tokens to flow")
    stack.registry.process.send_signal(signal.SIGTERM)
    assert stack.registry.process.wait(30) == 0
    stream.join(60)
    assert stream.error is None, stream.error
    assert stream.tokens == expected
    stack.registry = stack.suite.restart(stack.registry)
    with grpc.insecure_channel(stack.registry.address) as channel:
        listed = registry_pb2_grpc.RegistryStub(channel).ListModels(
            registry_pb2.ListModelsRegistryRequest(), timeout=5
        )
    assert ("tiny", "v1") in {(m.name, m.version) for m in listed.models}
