"""Worker failover for real: SIGKILL a worker mid-stream and every stream goes on, token for
token, on another worker; with none left, streams wait for a restarted one or fail
UNAVAILABLE when the wait is over."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import common_pb2
from tests.support import reference
from tests.support.stack import Stack
from tests.support.streams import Stream, generate, until
from tests.support.suite import Suite, wait_serving

WORKER_ARGS = ("--num-kv-blocks", "256", "--block-size", "8", "--threads", "1")
MAX_TOKENS = 300
PROMPTS = [f"Story number {i} begins on a quiet morning" for i in range(6)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Suite(tmp_path_factory.mktemp("failover"))
    try:
        registry = s.start_tiny_registry(tiny_model_dir, "--lease-ttl", "2")
        scheduler = s.start_scheduler(
            registry, "--max-step-stall", "0", "--failover-wait", "20", "--worker-timeout", "10"
        )
        st = Stack(s, registry, scheduler, gateway=None)  # type: ignore[arg-type]
        st.start_worker("worker-a", *WORKER_ARGS)
        st.start_worker("worker-b", *WORKER_ARGS)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        st.gateway = s.start_gateway(registry, scheduler)
        yield st
    finally:
        s.stop()


def test_sigkill_mid_stream_moves_every_stream_without_losing_a_token(stack: Stack) -> None:
    streams = [
        Stream(stack.gateway.address, p, MAX_TOKENS, seed=(7 + i if i % 2 else None))
        for i, p in enumerate(PROMPTS)
    ]
    for s in streams:
        s.start()
    until(lambda: all(len(s.tokens) >= 8 for s in streams), 60, "every stream to start")
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
        # Exactly the tokens of a fault-free run: nothing repeated, nothing missing.
        assert s.tokens == generate(stack.gateway.address, prompt, MAX_TOKENS, s.seed)
    assert "sequence moved" in stack.scheduler.log()
    stats = stack.stats()
    assert victim not in stats
    assert stats[survivor].num_free_blocks == stats[survivor].num_total_blocks
    # Restore two workers for the next test.
    stack.start_worker(victim, *WORKER_ARGS)


def test_sigkill_mid_stream_constrained_streams_continue_exactly(
    stack: Stack, tiny_model_dir: Path
) -> None:
    """The new worker rebuilds each grammar's state from the tokens already generated."""
    constraint = common_pb2.Constraint(regex=r"[a-z]{8}( [a-z]{1,8}){20}\.")
    streams = [
        Stream(stack.gateway.address, p, MAX_TOKENS, seed=3 + i, constraint=constraint)
        for i, p in enumerate(PROMPTS[:4])
    ]
    for s in streams:
        s.start()
    until(lambda: all(len(s.tokens) >= 8 for s in streams), 60, "every stream to start")
    running = {wid: w.num_running for wid, w in stack.stats().items()}
    victim = max(running, key=lambda wid: running[wid])
    assert running[victim] > 0, running
    stack.workers[victim].process.send_signal(signal.SIGKILL)
    for s in streams:
        s.join(120)
    for s, prompt in zip(streams, PROMPTS[:4], strict=True):
        assert s.error is None, s.error
        assert s.tokens == generate(stack.gateway.address, prompt, MAX_TOKENS, s.seed, constraint)
        text = reference.tokenizer(tiny_model_dir).decode(s.tokens)  # type: ignore[attr-defined]
        assert re.fullmatch(constraint.regex, text), text
    stack.start_worker(victim, *WORKER_ARGS)


def test_with_no_worker_left_a_stream_waits_for_a_restarted_one(stack: Stack) -> None:
    for name in list(stack.workers)[1:]:
        stack.workers.pop(name).terminate()
    (only,) = stack.workers
    until(lambda: set(stack.stats()) == {only}, 90, "one worker left")  # a bound, not a timing
    stream = Stream(stack.gateway.address, PROMPTS[0], MAX_TOKENS)
    stream.start()
    until(lambda: len(stream.tokens) >= 8, 60, "the stream to start")
    stack.workers.pop(only).process.send_signal(signal.SIGKILL)
    time.sleep(0.5)
    assert stream.is_alive() and stream.error is None  # waiting, not failed
    stack.start_worker("worker-c", *WORKER_ARGS)
    stream.join(120)
    assert stream.error is None, stream.error
    assert stream.tokens == generate(stack.gateway.address, PROMPTS[0], MAX_TOKENS)


def test_with_no_worker_coming_back_the_stream_fails_unavailable(
    stack: Stack, tmp_path: Path
) -> None:
    # A worker serves one scheduler's Run stream at a time: stop the stack's own first.
    assert stack.scheduler.terminate() == 0
    scheduler = stack.suite.start_scheduler(
        stack.registry, "--max-step-stall", "0", "--failover-wait", "1.5"
    )
    gateway = stack.suite.start_gateway(stack.registry, scheduler, name="gateway-2")
    wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
    stream = Stream(gateway.address, PROMPTS[1], MAX_TOKENS)
    stream.start()
    until(lambda: len(stream.tokens) >= 8, 60, "the stream to start")
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
        registry = s.start_tiny_registry(tiny_model_dir)
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0", "--worker-timeout", "2")
        st = Stack(s, registry, scheduler, gateway=None)  # type: ignore[arg-type]
        st.start_worker("worker-a", *WORKER_ARGS)
        st.start_worker("worker-b", *WORKER_ARGS)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        st.gateway = s.start_gateway(registry, scheduler)
        streams = [Stream(st.gateway.address, p, MAX_TOKENS) for p in PROMPTS[:4]]
        for stream in streams:
            stream.start()
        until(lambda: all(len(x.tokens) >= 8 for x in streams), 60, "every stream to start")
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
            assert stream.tokens == generate(st.gateway.address, prompt, MAX_TOKENS)
        assert "(--worker-timeout)" in scheduler.log()
    finally:
        s.stop()
