"""The Kubernetes base (deploy/k8s): kustomize and strict validation, probes, drains,
settings, replicas, Services, disruption budgets, the workers' GPUs and autoscaling."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml  # PyYAML, via transformers and kubernetes-validate

from tests.support.deploy import (
    CANTEEN_METRICS,
    K8S,
    K8S_BASE,
    READINESS,
    SERVICE_CONFIGS,
    _key,
    by_kind,
    containers,
    env_value,
    flag_value,
    k8s_docs,
    k8s_resources,
    known_env,
    kubernetes_validate,
    kustomize,
)


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


def test_kustomize_renders_the_base() -> None:
    assert sorted(map(_key, kustomize(K8S))) == sorted(map(_key, k8s_docs()))


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
