"""Worker failover for real: SIGKILL a worker mid-stream and every stream goes on, token for
token, on another worker; with none left, streams wait for a restarted one or fail
UNAVAILABLE when the wait is over."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.suite import Service, Suite, wait_serving

WORKER_ARGS = ("--num-kv-blocks", "256", "--block-size", "8", "--threads", "1")
MAX_TOKENS = 300
PROMPTS = [f"Story number {i} begins on a quiet morning" for i in range(6)]


@dataclass
class Stack:
    suite: Suite
    registry: Service
    scheduler: Service
    gateway: Service
    workers: dict[str, Service] = field(default_factory=dict)

    def start_worker(self, name: str) -> Service:
        svc = self.suite.start_worker(self.registry, "tiny", *WORKER_ARGS, name=name)
        self.workers[name] = svc
        return svc

    def stats(self) -> dict[str, scheduler_pb2.WorkerStats]:
        with grpc.insecure_channel(self.scheduler.address) as channel:
            reply = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=5
            )
        return {w.worker_id: w for w in reply.workers}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Suite(tmp_path_factory.mktemp("failover"))
    try:
        registry = s.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
            "--default-model",
            "tiny",
            "--lease-ttl",
            "2",
        )
        scheduler = s.start_scheduler(
            registry, "--max-step-stall", "0", "--failover-wait", "20", "--worker-timeout", "10"
        )
        st = Stack(s, registry, scheduler, gateway=None)  # type: ignore[arg-type]
        st.start_worker("worker-a")
        st.start_worker("worker-b")
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        st.gateway = s.start_gateway(registry, scheduler)
        yield st
    finally:
        s.stop()


class Stream(threading.Thread):
    """One Generate call through the gateway, collecting its tokens as they come."""

    def __init__(self, gateway: Service, prompt: str, seed: int | None = None, **kw: int) -> None:
        super().__init__(daemon=True)
        self.request = inference_pb2.GenerateRequest(
            prompt=prompt, max_tokens=kw.get("max_tokens", MAX_TOKENS), ignore_eos=True
        )
        if seed is None:
            self.request.temperature = 0.0
        else:
            self.request.temperature, self.request.seed = 1.0, seed
        self.address, self.tokens, self.error = gateway.address, [], None
        self.timeout = kw.get("timeout", 120)
        self.tokens: list[int]
        self.error: grpc.RpcError | None

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            try:
                for msg in stub.Generate(self.request, timeout=self.timeout):
                    self.tokens.extend(msg.token_ids)
            except grpc.RpcError as exc:
                self.error = exc


def _wait(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _reference(gateway: Service, prompt: str, seed: int | None, max_tokens: int) -> list[int]:
    ref = Stream(gateway, prompt, seed, max_tokens=max_tokens)
    ref.run()
    assert ref.error is None, ref.error
    return ref.tokens


def test_sigkill_mid_stream_moves_every_stream_without_losing_a_token(stack: Stack) -> None:
    streams = [
        Stream(stack.gateway, p, seed=(7 + i if i % 2 else None)) for i, p in enumerate(PROMPTS)
    ]
    for s in streams:
        s.start()
    _wait(lambda: all(len(s.tokens) >= 8 for s in streams), 60, "every stream to start")
    running = {wid: w.num_running for wid, w in stack.stats().items()}
    victim = max(running, key=lambda wid: running[wid])
    assert running[victim] > 0, running
    stack.workers[victim].process.send_signal(signal.SIGKILL)
    for s in streams:
        s.join(120)
    survivor = next(w for w in stack.workers if w != victim)
    assert stack.workers[survivor].process.poll() is None
    for s, prompt in zip(streams, PROMPTS, strict=True):
        assert s.error is None, s.error
        seed = s.request.seed if s.request.temperature else None
        # Exactly the tokens of a fault-free run: nothing repeated, nothing missing.
        assert s.tokens == _reference(stack.gateway, prompt, seed, MAX_TOKENS)
    assert "sequence moved" in stack.scheduler.log()
    stats = stack.stats()
    assert victim not in stats
    assert stats[survivor].num_free_blocks == stats[survivor].num_total_blocks
    # Restore two workers for the next test.
    stack.start_worker(victim)


def test_with_no_worker_left_a_stream_waits_for_a_restarted_one(stack: Stack) -> None:
    for name in list(stack.workers)[1:]:
        stack.workers.pop(name).terminate()
    (only,) = stack.workers
    _wait(lambda: set(stack.stats()) == {only}, 30, "one worker left")
    stream = Stream(stack.gateway, PROMPTS[0], max_tokens=MAX_TOKENS)
    stream.start()
    _wait(lambda: len(stream.tokens) >= 8, 60, "the stream to start")
    stack.workers.pop(only).process.send_signal(signal.SIGKILL)
    time.sleep(0.5)
    assert stream.is_alive() and stream.error is None  # waiting, not failed
    stack.start_worker("worker-c")
    stream.join(120)
    assert stream.error is None, stream.error
    assert stream.tokens == _reference(stack.gateway, PROMPTS[0], None, MAX_TOKENS)


def test_with_no_worker_coming_back_the_stream_fails_unavailable(
    stack: Stack, tmp_path: Path
) -> None:
    scheduler = stack.suite.start_scheduler(
        stack.registry, "--max-step-stall", "0", "--failover-wait", "1.5"
    )
    gateway = stack.suite.start_gateway(stack.registry, scheduler, name="gateway-2")
    wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
    stream = Stream(gateway, PROMPTS[1])
    stream.start()
    _wait(lambda: len(stream.tokens) >= 8, 60, "the stream to start")
    for name in list(stack.workers):
        stack.workers.pop(name).process.send_signal(signal.SIGKILL)
    started = time.monotonic()
    stream.join(60)
    assert stream.error is not None
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "was lost and no other ready worker serves tiny:v1" in stream.error.details()
    assert time.monotonic() - started < 15


def test_a_worker_that_stops_answering_is_lost_after_the_worker_timeout(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    s = Suite(tmp_path_factory.mktemp("silent-worker"))
    try:
        registry = s.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
            "--default-model",
            "tiny",
        )
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0", "--worker-timeout", "2")
        st = Stack(s, registry, scheduler, gateway=None)  # type: ignore[arg-type]
        st.start_worker("worker-a")
        st.start_worker("worker-b")
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        st.gateway = s.start_gateway(registry, scheduler)
        streams = [Stream(st.gateway, p) for p in PROMPTS[:4]]
        for stream in streams:
            stream.start()
        _wait(lambda: all(len(x.tokens) >= 8 for x in streams), 60, "every stream to start")
        running = {wid: w.num_running for wid, w in st.stats().items()}
        victim = max(running, key=lambda wid: running[wid])
        st.workers[victim].process.send_signal(signal.SIGSTOP)  # alive, but silent
        try:
            for stream in streams:
                stream.join(120)
        finally:
            st.workers[victim].process.send_signal(signal.SIGCONT)
        for stream, prompt in zip(streams, PROMPTS, strict=False):
            assert stream.error is None, stream.error
            assert stream.tokens == _reference(st.gateway, prompt, None, MAX_TOKENS)
        assert "(--worker-timeout)" in scheduler.log()
    finally:
        s.stop()
