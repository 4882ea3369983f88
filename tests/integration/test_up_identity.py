"""``canteen up`` makes one certificate per worker and never writes the CA's key (issue 32)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from tests.support.streams import until
from tests.support.up import Up

pytestmark = pytest.mark.timeout(600)


def _uris(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def test_up_gives_each_worker_its_own_certificate_and_keeps_the_ca_key_off_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    up = Up(
        tmp_path,
        tiny_model_dir,
        *("--workers", "2"),
        *("--worker-arg=--num-kv-blocks=64", "--worker-arg=--threads=1"),
    )
    try:
        up.start()
        until(lambda: {"worker-0", "worker-1"} <= set(up.stats()), 60, "both workers")
        certs = up.data / "certs"
        assert sorted(p.name for p in tmp_path.rglob("ca.key")) == []
        assert sorted(p.name for p in certs.iterdir()) == sorted(
            [
                f"{role}.{ext}"
                for role in ("client", "gateway", "registry", "scheduler")
                for ext in ("key", "pem")
            ]
            + ["ca.pem", "worker"]
        )
        assert sorted(p.name for p in (certs / "worker").iterdir()) == [
            "worker-0.key",
            "worker-0.pem",
            "worker-1.key",
            "worker-1.pem",
        ]
        for i in (0, 1):
            assert _uris(certs / "worker" / f"worker-{i}.pem") == [
                f"spiffe://canteen/worker/worker-{i}"
            ]
        for role in ("registry", "scheduler", "gateway", "client"):
            assert _uris(certs / f"{role}.pem") == [f"spiffe://canteen/{role}"]
        for key in certs.rglob("*.key"):
            assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    finally:
        assert up.stop() == 0
