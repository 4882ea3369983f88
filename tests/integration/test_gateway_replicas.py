"""Two gateway processes on one gRPC port and one HTTP port (``--reuse-port``), in front of
one scheduler: the kernel spreads connections over both, each counts its own requests on its
own metrics port, and when one dies the other keeps serving on the same ports."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.replicas import (
    complete_over_http,
    expected_greedy,
    generate_on_new_connection,
    requests_served,
)
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, free_port, wait_serving


@pytest.fixture(scope="module")
def replicas(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Suite, list[Service]]]:
    suite = Suite(tmp_path_factory.mktemp("replicas"))
    try:
        registry = suite.start_tiny_registry(tiny_model_dir)
        scheduler = suite.start_scheduler(registry)
        suite.start_worker(registry, "tiny", "--threads", "1", *TRANSFORMERS_DTYPE)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        port, http_port = free_port(), free_port()
        gateways = []
        for i in range(2):
            args = ["--registry", registry.address, "--scheduler", scheduler.address]
            args += ["--http-port", str(http_port), "--reuse-port"]
            args += ["--health-port", str(free_port())]
            svc = suite.spawn(f"gateway-{i}", "gateway", args, "canteen.v1.Inference", port=port)
            svc.http_port = http_port
            gateways.append(svc)
        yield suite, gateways
    finally:
        suite.stop()


def _counts(gateways: list[Service]) -> list[float]:
    return [requests_served(g.metrics_url) for g in gateways]


def test_both_processes_serve_the_one_port_with_exact_tokens(
    replicas: tuple[Suite, list[Service]], tiny_model_dir: Path
) -> None:
    _, gateways = replicas
    expected, text = expected_greedy(tiny_model_dir)
    before = _counts(gateways)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(generate_on_new_connection, [gateways[0].address] * 24))
    assert got == [expected] * 24
    served = [n - b for n, b in zip(_counts(gateways), before, strict=True)]
    assert sum(served) == 24
    assert min(served) >= 1, f"the kernel gave every connection to one process: {served}"
    before_http = _counts(gateways)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(complete_over_http, [gateways[0].http_url] * 24))
    assert texts == [text] * 24
    served_http = [n - b for n, b in zip(_counts(gateways), before_http, strict=True)]
    assert sum(served_http) == 24 and min(served_http) >= 1, served_http


def test_without_reuse_port_a_third_process_cannot_take_the_port(
    replicas: tuple[Suite, list[Service]],
) -> None:
    _, gateways = replicas
    argv = [sys.executable, "-m", "gateway", "--port", str(gateways[0].port), "--insecure"]
    argv += ["--http-port", "-1", "--scheduler", "127.0.0.1:1", "--registry", "127.0.0.1:1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert f"Failed to bind to address 127.0.0.1:{gateways[0].port}" in done.stderr


def test_the_other_process_serves_on_when_one_is_killed(
    replicas: tuple[Suite, list[Service]], tiny_model_dir: Path
) -> None:
    _, gateways = replicas
    expected, text = expected_greedy(tiny_model_dir)
    gateways[0].process.send_signal(signal.SIGKILL)
    gateways[0].process.wait(10)
    before = requests_served(gateways[1].metrics_url)
    got = [generate_on_new_connection(gateways[0].address) for _ in range(8)]
    assert got == [expected] * 8
    assert complete_over_http(gateways[0].http_url) == text
    assert requests_served(gateways[1].metrics_url) - before == 9
