"""One request, one trace: spans from the gateway, the scheduler and the worker, exported over
OTLP to a real gRPC collector endpoint on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.otlp import Collector, running_collector
from tests.support.suite import Service, Suite, wait_serving

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass
class TracedStack:
    collector: Collector
    gateway: Service


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedStack]:
    with running_collector() as (collector, endpoint):
        yield from _traced_stack(collector, endpoint, tiny_model_dir, tmp_path_factory)


def _traced_stack(
    collector: Collector, endpoint: str, model: Path, tmp: pytest.TempPathFactory
) -> Iterator[TracedStack]:
    otlp = ("--otlp-endpoint", endpoint)
    suite = Suite(tmp.mktemp("traced"))
    try:
        registry = suite.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={model}",
            "--default-model",
            "tiny",
        )
        scheduler = suite.start_scheduler(registry, *otlp)
        suite.start_worker(registry, "tiny", "--num-kv-blocks", "32", "--threads", "1", *otlp)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateway = suite.start_gateway(registry, scheduler, *otlp)
        yield TracedStack(collector, gateway)
    finally:
        suite.stop()


def _generate(gateway: Service, metadata: tuple[tuple[str, str], ...]) -> str:
    with grpc.insecure_channel(gateway.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt="trace me", max_tokens=4, ignore_eos=True),
            metadata=metadata,
        )
        messages = list(call)
        assert messages[-1].usage.completion_tokens == 4
        return str(dict(call.initial_metadata())["x-request-id"])


SERVICES = {"canteen-gateway", "canteen-scheduler", "canteen-worker"}


def test_one_trace_spans_gateway_scheduler_and_worker(traced: TracedStack) -> None:
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    _generate(traced.gateway, (("traceparent", traceparent),))
    spans = traced.collector.trace(CLIENT_TRACE_ID, SERVICES)
    by_service = {s.service: s for s in spans}
    gateway = by_service["canteen-gateway"]
    scheduler = by_service["canteen-scheduler"]
    worker = by_service["canteen-worker"]
    assert (gateway.name, scheduler.name, worker.name) == (
        "gateway.generate",
        "scheduler.generate",
        "worker.sequence",
    )
    # A chain: the client's span → gateway → scheduler → worker.
    assert gateway.parent_id == CLIENT_SPAN_ID
    assert scheduler.parent_id == gateway.span_id
    assert worker.parent_id == scheduler.span_id


def test_a_request_without_context_starts_its_own_trace(traced: TracedStack) -> None:
    before = {s.trace_id for s in traced.collector.spans}
    _generate(traced.gateway, ())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        fresh = [
            s
            for s in traced.collector.spans
            if s.service == "canteen-gateway" and s.trace_id not in before
        ]
        if fresh:
            break
        time.sleep(0.1)
    assert fresh, "the gateway exported no span for the request"
    assert fresh[0].parent_id == ""
    spans = traced.collector.trace(fresh[0].trace_id, SERVICES)
    assert len({s.trace_id for s in spans}) == 1
