"""canteen bench and canteen capacity as a user runs them, against the real tiny suite."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.conftest import TinySuite

SMALL = ["--input-len", "16", "--output-len", "8", "--no-progress", "--request-timeout", "60"]


def canteen(*args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "canteen.cli", *args], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == expect, done.stderr
    return done


def target(suite: TinySuite, protocol: str) -> list[str]:
    where = ["--address", suite.gateway.address, "--url", suite.gateway.http_url]
    return ["--protocol", protocol, *where]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bench_completes_every_request_with_the_asked_lengths(
    suite: TinySuite, tmp_path: Path, protocol: str
) -> None:
    out = tmp_path / "bench.json"
    args = ["--num-requests", "12", "--concurrency", "4", "--json", str(out)]
    done = canteen("bench", *target(suite, protocol), *SMALL, *args)
    assert "concurrency 4" in done.stdout and "Output token throughput" in done.stdout
    (run,) = json.loads(out.read_text())["runs"]
    s, records = run["summary"], run["records"]
    assert (s["num_completed"], s["num_failed"], s["errors"]) == (12, 0, {})
    assert len(records) == 12
    assert all(4 <= r["max_tokens"] <= 12 for r in records)  # 8 +/- 50%
    assert [r["completion_tokens"] for r in records] == [r["max_tokens"] for r in records]
    assert sum(r["completion_tokens"] for r in records) == s["total_output_tokens"]
    assert sum(r["prompt_tokens"] for r in records) == s["total_input_tokens"]
    assert all(r["prompt_tokens"] > 0 and r["error"] is None for r in records)
    # prompts sized with the server's tokenizer land near the asked length on average
    ratio = np.mean([r["prompt_tokens"] / r["prompt_len"] for r in records])
    assert 0.6 < ratio < 1.6
    for r in records:
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) >= 1
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (r["completion_tokens"] - 1))
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration"])


def _levels(report: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(concurrency, p90 TTFT, mean E2E) per level, recomputed from the records."""
    out = []
    for run in report["runs"]:
        ttft = [r["ttft"] for r in run["records"]]
        e2e = [r["e2e"] for r in run["records"]]
        out.append((run["concurrency"], float(np.percentile(ttft, 90)), float(np.mean(e2e))))
    return out


def test_sweep_plot_and_capacity_from_its_json(suite: TinySuite, tmp_path: Path) -> None:
    sweep, png, plan_json = tmp_path / "sweep.json", tmp_path / "sweep.png", tmp_path / "cap.json"
    args = ["--mode", "sweep", "--sweep", "1,2", "--num-requests", "4", "--slo-ttft", "30"]
    done = canteen(
        "bench", *target(suite, "grpc"), *SMALL, *args, "--json", str(sweep), "--plot", str(png)
    )
    assert "sweep" in done.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    report = json.loads(sweep.read_text())
    assert [r["concurrency"] for r in report["runs"]] == [1, 2]
    assert all(r["summary"]["num_completed"] == 4 for r in report["runs"])
    assert all(r["summary"]["goodput"] is not None for r in report["runs"])

    qps = 20.0
    done = canteen(
        "capacity", "--from", str(sweep), "--qps", str(qps), "--slo-ttft", "30",
        "--json", str(plan_json),
    )  # fmt: skip
    levels = _levels(report)
    concurrency, p90, mean_e2e = max(lv for lv in levels if lv[1] <= 30)
    k = math.ceil(qps * mean_e2e / concurrency)
    assert f"chosen level: concurrency {concurrency}" in done.stdout
    assert f"instances: {k}\n" in done.stdout
    plan = json.loads(plan_json.read_text())
    assert plan["num_instances"] == k and plan["level"]["concurrency"] == concurrency
    assert plan["level"]["ttft"] == pytest.approx(p90)
    assert plan["level"]["mean_e2e"] == pytest.approx(mean_e2e)

    done = canteen("capacity", "--from", str(sweep), "--qps", "20", "--slo-ttft", "1e-9", expect=1)
    best = min(levels, key=lambda lv: lv[1])
    assert f"best measured p90 TTFT {best[1]:.4f} s at concurrency {best[0]}" in done.stderr
