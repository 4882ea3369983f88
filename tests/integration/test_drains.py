"""Drains, deadlines and load shedding for real: SIGTERM a worker, the scheduler and a
gateway under load; a client deadline that expires mid-stream; a flood past the queue."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.stack import Stack
from tests.support.streams import Stream, generate, until
from tests.support.suite import Suite, wait_serving

ARGS = ("--block-size", "8", "--threads", "1")
BIG, SMALL = 520, 200  # worker-a's and worker-b's blocks: the router fills worker-a first
LONG = 1000  # tokens of a long stream (127 blocks: fits either worker)


def _not_ready(address: str, service: str) -> bool:
    """Whether ``service`` at ``address`` answers NOT_SERVING: a drain has begun."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Suite(tmp_path_factory.mktemp("drains"))
    try:
        registry = s.start_tiny_registry(tiny_model_dir)
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0", "--max-queue", "6")
        a = s.start_worker(registry, "tiny", "--num-kv-blocks", str(BIG), *ARGS, name="worker-a")
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateway = s.start_gateway(registry, scheduler, "--scheduler-retry", "30")
        yield Stack(s, registry, scheduler, gateway, {"worker-a": a})
    finally:
        s.stop()


def test_rolling_worker_restart_under_load_loses_nothing(stack: Stack) -> None:
    b = stack.suite.start_worker(
        stack.registry, "tiny", "--num-kv-blocks", str(SMALL), *ARGS, name="worker-b"
    )
    stack.workers["worker-b"] = b
    until(lambda: "worker-b" in stack.stats(), 30, "worker-b to connect")
    prompts = [f"Rolling restart story {i}" for i in range(4)]
    streams = [Stream(stack.gateway.address, p, LONG) for p in prompts]
    for s in streams:
        s.start()
    until(lambda: all(len(s.tokens) >= 4 for s in streams), 60, "the streams to start")
    assert stack.stats()["worker-a"].num_running == 4
    a = stack.workers.pop("worker-a")
    a.process.send_signal(signal.SIGTERM)
    # While worker-a drains, new work goes to worker-b.
    assert len(generate(stack.gateway.address, "new work during the drain", 16)) == 16
    for s in streams:
        s.join(120)
    assert a.process.wait(60) == 0
    assert "drain" in a.log() or "stopped" in a.log()
    for s, prompt in zip(streams, prompts, strict=True):
        assert s.error is None, s.error
        assert s.tokens == generate(stack.gateway.address, prompt, LONG)  # on worker-b now
    assert set(stack.stats()) == {"worker-b"}


def test_scheduler_sigterm_finishes_streams_and_new_work_waits_for_the_next(
    stack: Stack,
) -> None:
    prompt = "The scheduler drains"
    expected = generate(stack.gateway.address, prompt, 300)
    stream = Stream(stack.gateway.address, prompt, 300)
    stream.start()
    until(lambda: len(stream.tokens) >= 4, 60, "tokens to flow")
    old = stack.scheduler
    old.process.send_signal(signal.SIGTERM)
    until(lambda: _not_ready(old.address, "canteen.v1.Scheduler"), 10, "the scheduler to drain")
    late = Stream(stack.gateway.address, prompt, 300)
    late.start()  # refused UNAVAILABLE by the draining scheduler: the gateway retries it
    stream.join(60)
    assert stream.error is None, stream.error
    assert stream.tokens == expected
    assert old.process.wait(60) == 0
    assert late.is_alive() and late.error is None
    stack.scheduler = stack.suite.restart(old, wait_ready=False)
    late.join(60)
    assert late.error is None, late.error
    assert late.tokens == expected


def test_gateway_sigterm_finishes_an_sse_stream_and_refuses_new_http_work(
    stack: Stack,
) -> None:
    gateway = stack.suite.start_gateway(stack.registry, stack.scheduler, name="gateway-2")
    url = f"{gateway.http_url}/v1/completions"
    body = {"model": "tiny", "prompt": "SSE drain", "max_tokens": 400, "ignore_eos": True}
    lines: list[str] = []

    def read() -> None:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url, json={**body, "stream": True}) as reply,
        ):
            lines.extend(line for line in reply.iter_lines() if line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    until(lambda: len(lines) >= 4, 60, "SSE chunks")
    gateway.process.send_signal(signal.SIGTERM)
    healthz = f"{gateway.http_url}/healthz"
    until(lambda: httpx.get(healthz, timeout=5).status_code == 503, 10, "the gateway to drain")
    refused = httpx.post(url, json=body, timeout=10)
    assert refused.status_code == 503
    assert "draining" in refused.json()["error"]["message"]
    reader.join(60)
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in lines[-2] or '"finish_reason":"length"' in lines[-2]
    assert gateway.process.wait(60) == 0


def test_an_expired_deadline_frees_the_request_within_a_step(stack: Stack) -> None:
    stream = Stream(stack.gateway.address, "I will run out of time", LONG, timeout=0.5)
    stream.run()
    assert stream.error is not None
    assert stream.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(stream.tokens) < LONG

    def all_free() -> bool:
        return all(
            w.num_free_blocks == w.num_total_blocks and w.num_running == w.num_waiting == 0
            for w in stack.stats().values()
        )

    until(all_free, 5, "every block to be free")


def test_a_flood_is_shed_at_the_queue_and_health_keeps_answering(stack: Stack) -> None:
    streams = [Stream(stack.gateway.address, f"flood {i}", 200) for i in range(60)]
    health: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        with grpc.insecure_channel(stack.gateway.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service="canteen.v1.Inference"), timeout=5
                )
                health.append(reply.status)
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    # The workers are busy (paused mid-step): nothing leaves the queue while the flood
    # arrives, so what is past --max-queue 6 is shed, however fast the steps would be.
    lead = Stream(stack.gateway.address, "flood lead", 200)
    lead.start()
    until(lambda: len(lead.tokens) >= 2, 60, "the lead stream to start")
    workers = list(stack.workers.values())
    for worker in workers:
        worker.process.send_signal(signal.SIGSTOP)
    try:
        for s in streams:
            s.start()
        # A plan already on its way may admit a few more before the link waits on the
        # paused worker; everything else is queued (6) or shed at once.
        until(lambda: sum(not s.is_alive() for s in streams) >= 30, 20, "the flood to be shed")

        def all_arrived() -> bool:  # every request shed, queued or running
            held = sum(w.num_running + w.num_waiting for w in stack.stats().values())
            return sum(not s.is_alive() for s in streams) + held == 1 + len(streams)

        until(all_arrived, 20, "the last arrivals to be queued or shed")
    finally:
        for worker in workers:
            worker.process.send_signal(signal.SIGCONT)
    for s in [lead, *streams]:
        s.join(180)
    stop.set()
    prober.join(10)
    shed = [s for s in streams if s.error is not None]
    served = [s for s in [lead, *streams] if s.error is None]
    assert len(shed) >= 30 and len(served) >= 7 and len(shed) + len(served) == 61
    for s in shed:
        assert s.error is not None  # as picked for shed: narrows the type
        assert s.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, s.error
        assert "queue is full" in s.error.details()
        assert s.tokens == []
    expected = {len(s.tokens) for s in served}
    assert expected == {200}
    assert health and set(health) == {health_pb2.HealthCheckResponse.SERVING}
