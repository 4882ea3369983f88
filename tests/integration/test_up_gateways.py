"""``canteen up --gateways 2``: two gateway processes on the suite's one gateway port, both
serving, each supervised on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.replicas import (
    complete_over_http,
    expected_greedy,
    generate_on_new_connection,
    requests_served,
)
from tests.support.streams import until
from tests.support.up import Up, free_base_port

pytestmark = pytest.mark.timeout(600)
GATEWAYS = ("gateway-0", "gateway-1")


def _served(up: Up) -> list[float]:
    return [
        requests_served(f"http://127.0.0.1:{up.child(name).metrics_port}/metrics")
        for name in GATEWAYS
    ]


def test_up_runs_two_gateways_on_one_port_and_restarts_each_on_its_own(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    up = Up(
        tmp_path,
        tiny_model_dir,
        "--gateways",
        "2",
        *("--worker-arg=--threads=1", "--worker-arg=--dtype=float32"),
        base=free_base_port(160),
    )
    try:
        up.start()
        listed = [line.split()[0] for line in up.ready_lines if "shares the gateway" in line]
        assert listed == list(GATEWAYS)
        children = [up.child(name) for name in GATEWAYS]
        assert [c.state for c in children] == ["ready", "ready"]
        assert [c.port for c in children] == [up.base, up.base]
        assert [c.health_port for c in children] == [up.base + 138, up.base + 139]
        assert len({c.pid for c in children}) == 2
        expected, text = expected_greedy(tiny_model_dir)
        before = _served(up)
        assert [generate_on_new_connection(up.gateway) for _ in range(16)] == [expected] * 16
        served = [n - b for n, b in zip(_served(up), before, strict=True)]
        assert sum(served) == 16 and min(served) >= 1, served
        old_pid = up.kill("gateway-1")
        # Until the launcher reaped it: a dying process's listener resets what it queued.
        until(lambda: up.child("gateway-1").pid != old_pid, 30, "gateway-1 reaped")
        assert generate_on_new_connection(up.gateway) == expected
        http = f"http://127.0.0.1:{up.base + 6}"
        assert complete_over_http(http) == text
        until(lambda: up.child("gateway-1").restarts == 1, 60, "gateway-1 restarted")
        until(lambda: up.child("gateway-1").state == "ready", 120, "gateway-1 ready again")
        assert up.child("gateway-1").pid != old_pid
        assert up.child("gateway-0").restarts == 0
        assert any("gateway-1 is ready again" in m for m in up.messages()), up.messages()
        before = _served(up)
        assert [generate_on_new_connection(up.gateway) for _ in range(16)] == [expected] * 16
        served = [n - b for n, b in zip(_served(up), before, strict=True)]
        assert sum(served) == 16 and min(served) >= 1, served
    finally:
        assert up.stop() == 0, up.stderr()[-3000:]
