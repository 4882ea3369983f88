"""One request, one trace: spans from the gateway, the scheduler and the worker, exported over
OTLP to a real gRPC collector endpoint on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import Service, Suite, free_port, wait_serving

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(
                            Span(
                                attrs.get("service.name", ""),
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, services: set[str], timeout: float = 20.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if services <= {s.service for s in spans}:
                return spans
            time.sleep(0.1)
        raise AssertionError(f"trace {trace_id} has only {spans}")


@dataclass
class TracedStack:
    collector: Collector
    gateway: Service


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedStack]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    otlp = ("--otlp-endpoint", f"http://127.0.0.1:{port}")
    suite = Suite(tmp_path_factory.mktemp("traced"))
    try:
        registry = suite.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
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
        server.stop(0)


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
