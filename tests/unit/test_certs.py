"""Certificates name one role each; keys are never written over a file or through a link."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from canteen.certs import build_cert, issue, load_ca, main, make_suite_certs, new_ca
from canteen.tls import Peer, identity_of
from registry.directory import NotLeaseOwnerError, WorkerDirectory, WorkerEntry


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def test_each_certificate_names_one_role_by_uri_and_a_worker_by_its_id() -> None:
    ca = new_ca()
    scheduler, _ = build_cert("scheduler", ["localhost"], ca)
    worker, _ = build_cert("worker", ["localhost"], ca, "gpu-7")
    assert identity_of(_pem(scheduler)) == Peer("scheduler")
    assert identity_of(_pem(worker)) == Peer("worker", "gpu-7")
    san = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["worker", "gpu-7.worker.canteen", "localhost"]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://canteen/worker/gpu-7"
    ]


@pytest.mark.parametrize("worker_id", ["", "a/b", "-x", "x" * 64, "a b"])
def test_a_worker_id_no_certificate_can_name_is_refused(worker_id: str) -> None:
    with pytest.raises(ValueError, match=r"worker_id=.*1 to 63 letters, digits"):
        build_cert("worker", [], new_ca(), worker_id)


def test_keys_are_0600_and_never_overwrite_or_follow_a_link(tmp_path: Path) -> None:
    make_suite_certs(tmp_path / "a", workers=["w1"])
    key = tmp_path / "a" / "worker" / "w1.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "a" / "ca.key").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError, match=r"w1\.pem: already exists"):
        issue(tmp_path / "a", "worker", [], load_ca(tmp_path / "a"), "w1")
    target = tmp_path / "elsewhere"
    (tmp_path / "b" / "worker").mkdir(parents=True)
    os.symlink(target, tmp_path / "b" / "worker" / "w2.key")
    with pytest.raises(OSError):
        issue(tmp_path / "b", "worker", [], new_ca(), "w2")
    assert not target.exists()


def test_make_suite_certs_can_keep_the_ca_key_in_memory(tmp_path: Path) -> None:
    make_suite_certs(tmp_path, workers=["w1", "w2"], keep_ca_key=False)
    assert not (tmp_path / "ca.key").exists()
    assert sorted(p.name for p in (tmp_path / "worker").iterdir()) == [
        "w1.key",
        "w1.pem",
        "w2.key",
        "w2.pem",
    ]


def test_canteen_certs_adds_a_worker_to_an_existing_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main([str(tmp_path), "--workers", "w1"])
    main([str(tmp_path), "--workers", "w2", "--add-workers"])
    assert "wrote certificates for workers w2" in capsys.readouterr().out
    pem = (tmp_path / "worker" / "w2.pem").read_bytes()
    assert identity_of(pem) == Peer("worker", "w2")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--workers", "w3"])  # a second CA over the first: refused
    assert exit_info.value.code == 2
    assert "ca.pem: already exists" in capsys.readouterr().err


def test_a_lease_is_held_only_by_the_worker_its_certificate_names() -> None:
    async def scenario() -> list[str]:
        directory = WorkerDirectory(ttl_seconds=30)
        await directory.register(WorkerEntry("w1", "127.0.0.1:1", "m", "v"), owner="w1")
        errors = []
        for attempt in (
            directory.register(WorkerEntry("w1", "127.0.0.1:2", "m", "v"), owner="w2"),
            directory.heartbeat("w1", owner="w2"),
            directory.deregister("w1", owner="w2"),
        ):
            with pytest.raises(NotLeaseOwnerError) as info:
                await attempt
            errors.append(str(info.value))
        assert [w.address for w in directory.snapshot()] == ["127.0.0.1:1"]
        return errors

    errors = asyncio.run(scenario())
    assert set(errors) == {
        "worker_id='w1': this caller's certificate is for worker 'w2' "
        "(spiffe://canteen/worker/w2); a worker may register, heartbeat and deregister only "
        "its own id"
    }
