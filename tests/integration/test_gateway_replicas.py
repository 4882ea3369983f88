"""Two gateway processes on one gRPC port and one HTTP port (``--reuse-port``), in front of
one scheduler: the kernel spreads connections over both, each counts its own requests on its
own metrics port, and when one dies the other keeps serving on the same ports."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support import reference
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, free_port, wait_serving

PROMPT = "Canteen batches requests"
MAX_TOKENS = 12


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


def _expected(tiny_model_dir: Path) -> list[int]:
    tok = reference.tokenizer(tiny_model_dir)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return reference.greedy(tiny_model_dir, ids, MAX_TOKENS)


def _generate_on_new_connection(address: str) -> list[int]:
    """One request on a channel of its own: a new TCP connection the kernel places (a local
    subchannel pool, or gRPC would share one connection between channels)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        )
        return [t for m in stub.Generate(request, timeout=60) for t in m.token_ids]


def _complete_over_http(url: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Connection": "close"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return str(json.load(reply)["choices"][0]["text"])


def _requests_served(gateway: Service) -> float:
    """The gateway's own canteen_requests_total, all statuses, from its metrics port."""
    with urllib.request.urlopen(gateway.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("canteen_requests_total{")
    )


def test_both_processes_serve_the_one_port_with_exact_tokens(
    replicas: tuple[Suite, list[Service]], tiny_model_dir: Path
) -> None:
    _, gateways = replicas
    expected = _expected(tiny_model_dir)
    before = [_requests_served(g) for g in gateways]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(_generate_on_new_connection, [gateways[0].address] * 24))
    assert got == [expected] * 24
    served = [_requests_served(g) - b for g, b in zip(gateways, before, strict=True)]
    assert sum(served) == 24
    assert min(served) >= 1, f"the kernel gave every connection to one process: {served}"
    tok = reference.tokenizer(tiny_model_dir)
    text = tok.decode(expected, skip_special_tokens=True)  # type: ignore[attr-defined]
    before_http = [_requests_served(g) for g in gateways]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(_complete_over_http, [gateways[0].http_url] * 24))
    assert texts == [text] * 24
    served_http = [_requests_served(g) - b for g, b in zip(gateways, before_http, strict=True)]
    assert sum(served_http) == 24 and min(served_http) >= 1, served_http


def test_the_other_process_serves_on_when_one_is_killed(
    replicas: tuple[Suite, list[Service]], tiny_model_dir: Path
) -> None:
    _, gateways = replicas
    expected = _expected(tiny_model_dir)
    gateways[0].process.send_signal(signal.SIGKILL)
    gateways[0].process.wait(10)
    before = _requests_served(gateways[1])
    got = [_generate_on_new_connection(gateways[0].address) for _ in range(8)]
    assert got == [expected] * 8
    assert _complete_over_http(gateways[0].http_url) == reference.tokenizer(
        tiny_model_dir
    ).decode(expected, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert _requests_served(gateways[1]) - before == 9
