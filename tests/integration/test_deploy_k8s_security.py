"""Kubernetes security: the NetworkPolicies, the pods' security contexts, the Secrets the
certificates and keys come from, and the cert-manager overlay that issues the certificates.

Security settings are checked as sets, so that anything opened beyond the intended links
fails: the NetworkPolicies' allowed links, the pods' security contexts, and where every
certificate and key comes from.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml  # PyYAML, via transformers and kubernetes-validate

from tests.support.deploy import (
    CERT_MANAGER,
    ROLES,
    SERVICE_CONFIGS,
    _key,
    by_kind,
    containers,
    dockerfile_arg,
    dockerfile_home,
    dockerfile_uid,
    env_value,
    flag_value,
    k8s_docs,
    kubernetes_validate,
    kustomize,
)

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
        ("gateway", "--admin-keys-file", "canteen-status-keys"),
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
    gateway_pod, gateway = next((w, c) for w, c in containers() if c["args"][0] == "gateway")
    assert "--allow-unauthenticated" not in gateway["args"]
    # The internet-facing gateway holds no registry write key: canteen-admin-keys is mounted
    # by the registry alone.
    secrets = {
        v["secret"]["secretName"]
        for v in gateway_pod["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert "canteen-admin-keys" not in secrets and "canteen-status-keys" in secrets
    # Every API key has limits by default.
    assert flag_value(gateway["args"], "--rate-limit-rpm") == "60"
    assert flag_value(gateway["args"], "--rate-limit-tpm") == "60000"
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
    """The overlay rendered by kustomize."""
    return kustomize(CERT_MANAGER)


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
