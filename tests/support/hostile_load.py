"""Hostile load for the edge, and what it must not disturb: a stream's tokens and gaps, and
health probes. Shared by tests/integration/test_edge_unstallable.py and bench/hostile.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.v1 import inference_pb2, inference_pb2_grpc

if TYPE_CHECKING:
    from tests.integration.conftest import TinySuite
    from tests.support.suite import Service

PROMPT = "Once upon a time"
BIG_PROMPT_CHARS = 4_000_000  # "a 4 MB tokenize"
NUM_TOOLS = 128


def _nested_schema(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def hostile_bodies() -> list[tuple[str, dict[str, object]]]:
    """(path, JSON body) of each hostile request: each fits the 4 MiB body limit."""
    words = "lorem ipsum dolor sit amet "
    big = (words * (BIG_PROMPT_CHARS // len(words) + 1))[:BIG_PROMPT_CHARS]
    chat = [{"role": "user", "content": "hi"}]
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "d" * 200} for i in range(40)},
    }
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "parameters": schema}}
        for i in range(NUM_TOOLS)
    ]
    deep = [{"type": "function", "function": {"name": "deep", "parameters": _nested_schema(100)}}]
    return [
        ("/tokenize", {"prompt": big}),
        ("/v1/completions", {"prompt": big[:3_900_000], "max_tokens": 1, "n": 4}),
        ("/v1/chat/completions", {"messages": chat, "tools": tools, "n": 4, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": chat, "tools": deep, "n": 4, "max_tokens": 1}),
    ]


@dataclass
class HostileResult:
    path: str
    status: int
    message: str
    seconds: float


def send_hostile(http_url: str, path: str, body: dict[str, object]) -> HostileResult:
    raw = json.dumps(body).encode()
    start = time.monotonic()
    response = httpx.post(
        http_url + path,
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    message = response.json().get("error", {}).get("message", "") if response.is_error else ""
    return HostileResult(path, response.status_code, message, time.monotonic() - start)


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)

    @property
    def worst_gap(self) -> float:
        """The longest wait between two messages after the first token."""
        return max(
            (b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)), default=0.0
        )


def run_stream(address: str, max_tokens: int) -> StreamResult:
    """A greedy stream of exactly ``max_tokens`` tokens, with each message's arrival."""
    result = StreamResult()
    request = inference_pb2.GenerateRequest(
        prompt=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    with grpc.insecure_channel(address) as channel:
        for msg in inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120):
            if msg.token_ids:
                result.token_ids.extend(msg.token_ids)
                result.arrivals.append(time.monotonic())
    return result


def probe_until(address: str, http_url: str, stop: threading.Event) -> list[float]:
    """Health probe latencies (gRPC Health/Check and HTTP /healthz, alternately, every
    20 ms) until ``stop``; a probe that fails or is not SERVING raises."""
    latencies: list[float] = []
    request = health_pb2.HealthCheckRequest(service="canteen.v1.Inference")
    with grpc.insecure_channel(address) as channel, httpx.Client(timeout=10) as http:
        health = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            start = time.monotonic()
            if len(latencies) % 2:
                assert http.get(http_url + "/healthz").status_code == 200
            else:
                reply = health.Check(request, timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    return latencies


@dataclass
class Round:
    stream: StreamResult
    probes: list[float]
    hostile: list[HostileResult]


def one_round(
    address: str, http_url: str, max_tokens: int, hostile: bool, wait: Callable[[], None]
) -> Round:
    """A stream and probes, alone or while every hostile request runs (sent just before the
    stream starts, so it runs during their preparation)."""
    stop = threading.Event()
    with ThreadPoolExecutor(8) as pool:
        prober = pool.submit(probe_until, address, http_url, stop)
        sent = (
            [pool.submit(send_hostile, http_url, p, b) for p, b in hostile_bodies()]
            if hostile
            else []
        )
        wait()
        stream = run_stream(address, max_tokens)
        results = [f.result() for f in sent]
        stop.set()
        probes = prober.result()
    return Round(stream, probes, results)


def start_roomy_gateway(suite: TinySuite, prep_deadline: float, name: str) -> Service:
    """A gateway that lets a 4 MB prompt through its size checks, so the preparation itself
    (seconds of tokenizing) is what the others must not wait for."""
    return suite.suite.start_gateway(
        suite.registry,
        suite.scheduler,
        "--max-prompt-chars",
        str(BIG_PROMPT_CHARS + 1000),
        "--prep-deadline",
        str(prep_deadline),
        name=name,
    )
