"""One worker certificate is one worker, and the scheduler believes a worker only within
bounds (issue 32): real registry, scheduler, worker and gateway on mutual TLS; the impostors
are this test's own gRPC clients and servers holding certificates of the suite's CA."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from canteen.certs import DEFAULT_HOSTS, issue, load_ca
from canteen.tls import Tls, sync_channel
from canteen.v1 import (
    registry_pb2,
    registry_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.security.conftest import KEY_A, SecureSuite
from tests.support.streams import Stream

TINY = {"model": "tiny", "version": "v1"}


def _worker_tls(secure: SecureSuite, worker_id: str) -> Tls:
    """A certificate of the suite's CA for ``worker_id`` (issued once per session)."""
    if not (secure.certs / "worker" / f"{worker_id}.pem").exists():
        issue(secure.certs, "worker", DEFAULT_HOSTS, load_ca(secure.certs), worker_id)
    return secure.tls("worker", worker_id)


def _registry(secure: SecureSuite, tls: Tls) -> registry_pb2_grpc.RegistryStub:
    return registry_pb2_grpc.RegistryStub(sync_channel(secure.registry.address, tls, "registry"))


def _directory(secure: SecureSuite) -> dict[str, str]:
    """The registry's live workers: id -> address."""
    stub = _registry(secure, secure.tls("client"))
    listed = next(stub.WatchWorkers(registry_pb2.WatchWorkersRequest(), timeout=10))
    return {w.worker_id: w.address for w in listed.workers}


def _stats(secure: SecureSuite) -> scheduler_pb2.GetStatsResponse:
    with sync_channel(secure.scheduler.address, secure.tls("client"), "scheduler") as channel:
        reply: scheduler_pb2.GetStatsResponse = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        )
    return reply


def _denied(call: grpc.UnaryUnaryMultiCallable, request: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    return str(info.value.details())


def _assert_real_worker_serves(secure: SecureSuite, address: str) -> None:
    assert _directory(secure)["worker"] == address
    auth = (("authorization", f"Bearer {KEY_A}"),)
    stream = Stream(secure.shared.address, "Still here after the impostor", 6, metadata=auth)
    stream.start()
    stream.join(120)
    assert stream.error is None and len(stream.tokens) == 6, stream.error


def test_another_workers_certificate_cannot_heartbeat_deregister_or_claim_its_id(
    secure: SecureSuite,
) -> None:
    address = _directory(secure)["worker"]
    intruder = _registry(secure, _worker_tls(secure, "intruder"))
    rule = (
        "worker_id='worker': this caller's certificate is for worker 'intruder' "
        "(spiffe://canteen/worker/intruder); a worker may register, heartbeat and deregister "
        "only its own id"
    )
    claim = registry_pb2.RegisterWorkerRequest(worker_id="worker", address="127.0.0.1:1", **TINY)
    assert _denied(intruder.RegisterWorker, claim) == rule
    assert _denied(intruder.Heartbeat, registry_pb2.HeartbeatRequest(worker_id="worker")) == rule
    assert (
        _denied(intruder.DeregisterWorker, registry_pb2.DeregisterWorkerRequest(worker_id="worker"))
        == rule
    )
    _assert_real_worker_serves(secure, address)


def _cert_without_role_uri(secure: SecureSuite, common_name: str) -> Tls:
    """Signed by the suite's CA, CN and DNS name ``common_name``, but no role URI SAN."""
    ca_cert, ca_key = load_ca(secure.certs)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name)])
    now = ca_cert.not_valid_before_utc
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(ca_cert.not_valid_after_utc)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Tls(cert.public_bytes(serialization.Encoding.PEM), pem_key, secure.tls("client").ca)


def test_a_certificate_with_the_right_cn_but_no_role_uri_is_refused(secure: SecureSuite) -> None:
    worker_cn = _registry(secure, _cert_without_role_uri(secure, "worker"))
    fake = registry_pb2.RegisterWorkerRequest(worker_id="worker", address="127.0.0.1:1", **TINY)
    rule = (
        "this caller's certificate names no role; the rule is exactly one URI SAN "
        "spiffe://canteen/<role> (or spiffe://canteen/worker/<id>)"
    )
    assert _denied(worker_cn.RegisterWorker, fake) == f"RegisterWorker: {rule}"
    # Methods open to every role are closed to a certificate that names none.
    request = registry_pb2.ListModelsRegistryRequest()
    assert _denied(worker_cn.ListModels, request) == f"ListModels: {rule}"
    client_cn = _cert_without_role_uri(secure, "client")
    with sync_channel(secure.scheduler.address, client_cn, "scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        assert _denied(stub.GetStats, scheduler_pb2.GetStatsRequest()) == f"GetStats: {rule}"
    assert "worker" in _directory(secure)


class _FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Answers GetInfo with whatever the test says; never runs a step."""

    def __init__(self, info: worker_pb2.WorkerInfo) -> None:
        self.info = info
        self.runs = 0

    def GetInfo(self, request: object, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        return self.info

    def Run(
        self, request_iterator: object, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.StepResult]:
        self.runs += 1
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "a fake worker")
        yield from ()


@contextmanager
def _fake_worker(
    secure: SecureSuite, info: worker_pb2.WorkerInfo, serving_as: str = ""
) -> Iterator[_FakeWorker]:
    """A worker server on loopback with ``serving_as``'s certificate (default: its own id's),
    registered in the registry under its own id's certificate; deregistered after."""
    servicer = _FakeWorker(info)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    served = _worker_tls(secure, serving_as or info.worker_id)
    port = server.add_secure_port("127.0.0.1:0", served.server_credentials())
    server.start()
    registry = _registry(secure, _worker_tls(secure, info.worker_id))
    entry = registry_pb2.RegisterWorkerRequest(
        worker_id=info.worker_id,
        address=f"127.0.0.1:{port}",
        model=info.model,
        version=info.version,
    )
    registry.RegisterWorker(entry, timeout=10)
    try:
        yield servicer
    finally:
        registry.DeregisterWorker(
            registry_pb2.DeregisterWorkerRequest(worker_id=info.worker_id), timeout=10
        )
        server.stop(None)


def _sane_info(worker_id: str, **changes: object) -> worker_pb2.WorkerInfo:
    fields: dict[str, object] = {
        "worker_id": worker_id,
        **TINY,
        "num_blocks": 64,
        "block_size": 8,
        "max_model_len": 512,
        "max_batched_tokens": 256,
        "vocab_size": 256,
        "eos_token_ids": [2],
    }
    return worker_pb2.WorkerInfo(**{**fields, **changes})  # type: ignore[arg-type]


def _refusal(secure: SecureSuite, worker_id: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(secure)
        for refused in stats.refused_workers:
            if refused.worker_id == worker_id:
                assert worker_id not in {w.worker_id for w in stats.workers}
                return refused.reason
        time.sleep(0.2)
    raise AssertionError(f"the scheduler did not refuse {worker_id}: {_stats(secure)}")


def test_an_absurd_num_blocks_is_refused_with_the_reason(secure: SecureSuite) -> None:
    address = _directory(secure)["worker"]
    info = _sane_info("hog", num_blocks=2**31 - 1)
    with _fake_worker(secure, info) as fake:
        reason = _refusal(secure, "hog")
        assert reason == "num_blocks=2147483647: must be in 1..2097152"
        assert fake.runs == 0
    log = secure.scheduler.log()
    assert '"worker refused"' in log and "num_blocks=2147483647: must be in 1..2097152" in log
    _assert_real_worker_serves(secure, address)


def test_a_worker_of_a_model_the_registry_does_not_list_gets_no_traffic(
    secure: SecureSuite,
) -> None:
    info = _sane_info("ghost", model="ghost", version="v9")
    with _fake_worker(secure, info) as fake:
        reason = _refusal(secure, "ghost")
        assert reason == (
            "model='ghost' version='v9': not in the registry's model list; a worker serves "
            "only a registered model version"
        )
        assert fake.runs == 0
    # Gone from the directory, gone from the refusals.
    deadline = time.monotonic() + 10
    while any(r.worker_id == "ghost" for r in _stats(secure).refused_workers):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_worker_reporting_another_id_than_the_directory_is_refused(
    secure: SecureSuite,
) -> None:
    info = _sane_info("liar")
    with _fake_worker(secure, info) as fake:
        fake.info = _sane_info("worker")  # GetInfo claims the real worker's id
        reason = _refusal(secure, "liar")
    assert reason == (
        "worker_id='worker': the registry's directory lists this worker with worker_id='liar'"
    )


def test_a_worker_serving_another_workers_certificate_is_not_dialled(
    secure: SecureSuite,
) -> None:
    info = _sane_info("imp")
    with _fake_worker(secure, info, serving_as="intruder") as fake:
        deadline = time.monotonic() + 15
        log = ""
        while '"worker_id": "imp"' not in log and time.monotonic() < deadline:
            time.sleep(0.2)
            log = "\n".join(
                line for line in secure.scheduler.log().splitlines() if "worker unreachable" in line
            )
        assert '"worker_id": "imp"' in log, log
        assert fake.runs == 0
        assert "imp" not in {w.worker_id for w in _stats(secure).workers}
