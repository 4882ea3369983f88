"""``canteen up`` survives its own children, for real: SIGKILL a worker under load, then the
scheduler, then make a worker and the registry crash again and again.

One suite for the module, in order: the first test kills the busiest worker mid-stream, the
last makes the registry crash until the suite gives up.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.streams import Stream, generate, until
from tests.support.up import Up

PROMPTS = [f"Supervised story number {i} begins" for i in range(8)]
LONG = 300  # tokens per stream: long enough to be mid-stream when the worker dies
# Greedy and seeded streams, alternately: both must continue exactly on another worker.
SEEDS = [None if i % 2 == 0 else 100 + i for i in range(8)]
# The default dtype: exact continuation after a move holds in it (README, Exactness).
WORKER_ARGS = ("--worker-arg=--num-kv-blocks=256", "--worker-arg=--threads=1")

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    suite = Up(
        tmp_path_factory.mktemp("supervised"),
        tiny_model_dir,
        "--workers",
        "2",
        *WORKER_ARGS,
        # Requests sent while the scheduler restarts wait for it (the default is 15 s).
        "--gateway-arg=--scheduler-retry=120",
    )
    try:
        yield suite.start()
    finally:
        suite.stop()


def _served(up: Up, name: str) -> bool:
    """Sends a few new requests at once; True when ``name`` computed a step of them."""
    before = up.stats()[name].num_steps
    streams = [Stream(up.gateway, f"Fresh prompt {i} for {name}", 24) for i in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        s.join(120)
        assert s.error is None and len(s.tokens) == 24, s.error
    return up.stats()[name].num_steps > before


def test_a_worker_killed_under_load_comes_back_and_every_stream_finishes_exactly(
    up: Up,
) -> None:
    references = [Stream(up.gateway, p, LONG, seed) for p, seed in zip(PROMPTS, SEEDS, strict=True)]
    for s in references:
        s.start()
    for s in references:
        s.join(120)
        assert s.error is None, s.error
    streams = [Stream(up.gateway, p, LONG, seed) for p, seed in zip(PROMPTS, SEEDS, strict=True)]
    for s in streams:
        s.start()
    until(lambda: all(len(s.tokens) >= 4 for s in streams), 120, "every stream to start")
    stats = up.stats()
    victim = max(stats, key=lambda w: stats[w].num_running)
    assert stats[victim].num_running > 0
    killed = up.kill(victim)
    for s in streams:
        s.join(180)
    for s, ref in zip(streams, references, strict=True):
        assert s.error is None, s.error
        assert s.tokens == ref.tokens  # moved to the other worker, nothing lost or repeated

    until(lambda: up.child(victim).state == "ready", 180, f"{victim} to be ready again")
    child = up.child(victim)
    assert (child.restarts, child.last_exit) == (1, "killed by SIGKILL")
    assert child.pid != killed
    assert any(f"{victim} (pid {killed}) killed by SIGKILL" in m for m in up.messages())
    until(
        lambda: up.stats().get(victim) is not None and up.stats()[victim].is_ready,
        60,
        f"the scheduler to use {victim} again",
    )
    until(lambda: _served(up, victim), 120, f"a request served by the restarted {victim}")
    # /status on the HTTP port (base + 6) shows the restart.
    page = httpx.get(f"http://127.0.0.1:{up.base + 6}/status.json", timeout=10).json()
    shown = {c["name"]: c for c in page["suite"]["children"]}
    assert (shown[victim]["restarts"], shown[victim]["state"]) == (1, "ready")


def test_a_killed_scheduler_comes_back_and_requests_sent_meanwhile_succeed(up: Up) -> None:
    prompts = [f"While the scheduler is away {i}" for i in range(4)]
    expected = [
        generate(up.gateway, p, 48, seed) for p, seed in zip(prompts, SEEDS[:4], strict=True)
    ]
    killed = up.kill("scheduler")
    # Sent while it is down: the gateway holds them until the restarted scheduler answers.
    streams = [Stream(up.gateway, p, 48, seed) for p, seed in zip(prompts, SEEDS[:4], strict=True)]
    for s in streams:
        s.start()
    for s in streams:
        s.join(240)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.tokens for s in streams] == expected
    scheduler = up.child("scheduler")
    assert scheduler.restarts == 1 and scheduler.pid != killed
    assert any(f"scheduler (pid {killed}) killed by SIGKILL" in m for m in up.messages())


def _crash_until_down(up: Up, name: str) -> list[int]:
    """SIGKILLs each new process of ``name`` as soon as it exists, until it stays down."""
    killed: list[int] = []
    while up.child(name).state != "down":
        pid = up.child(name).pid
        if pid is not None and pid not in killed:
            up.kill(name)
            killed.append(pid)
        until(
            lambda: up.child(name).state == "down" or up.child(name).pid not in (None, *killed),
            120,
            f"{name} to start again or stay down",
        )
    return killed


def test_a_worker_that_keeps_crashing_stays_down_and_the_suite_carries_on(up: Up) -> None:
    name = next(
        c.name for c in up.state().children if c.name.startswith("worker-") and c.restarts == 0
    )
    killed = _crash_until_down(up, name)
    assert len(killed) == 5  # it stayed down after its fifth crash, not before
    child = up.child(name)
    assert (child.state, child.restarts, child.pid) == ("down", 4, None)
    messages = up.messages()
    assert any(
        f"{name} (pid {killed[-1]}) killed by SIGKILL" in m and "stays down" in m for m in messages
    ), messages
    assert any(f"carries on without {name}" in m for m in messages), messages
    assert len(generate(up.gateway, "Still served by the other worker", 16)) == 16
    assert up.process is not None and up.process.poll() is None


def test_a_registry_that_keeps_crashing_stops_the_suite_with_a_message(up: Up) -> None:
    survivors = [c.pid for c in up.state().children if c.pid is not None and c.name != "registry"]
    _crash_until_down(up, "registry")
    assert up.process is not None
    assert up.process.wait(180) == 1
    messages = up.messages()
    assert any(
        "registry stays down and the suite cannot serve without it; stopping" in m for m in messages
    ), messages
    state = up.state()
    assert state.state == "failed" and "registry stays down" in state.message
    assert {c.state for c in state.children} <= {"stopped", "down"}
    for pid in survivors:  # every other child was stopped, none left behind
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
