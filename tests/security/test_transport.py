"""Mutual TLS on every internal port, and the role each RPC demands."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import pytest

from canteen.tls import Tls, sync_channel
from canteen.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.security.conftest import KEY_A, SecureSuite
from tests.support.streams import Stream, until
from tests.support.suite import ROOT, Service, free_port


def _call(svc: Service, channel: grpc.Channel) -> grpc.RpcError | None:
    """One harmless read on ``svc``'s own service; the error, or None when it answered."""
    try:
        if svc.module == "registry":
            registry_pb2_grpc.RegistryStub(channel).ListModels(
                registry_pb2.ListModelsRegistryRequest(), timeout=10
            )
        elif svc.module == "scheduler":
            scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=10
            )
        else:
            worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


def _probe(svc: Service, tls: Tls | None, role: str) -> grpc.RpcError | None:
    with sync_channel(svc.address, tls, role) as channel:
        return _call(svc, channel)


@pytest.mark.parametrize("module", ["registry", "scheduler", "worker"])
def test_internal_ports_refuse_clients_without_a_certificate_of_the_ca(
    secure: SecureSuite, module: str
) -> None:
    svc = {"registry": secure.registry, "scheduler": secure.scheduler, "worker": secure.worker}[
        module
    ]
    assert _probe(svc, secure.tls("client"), module) is None  # the CA's client gets in
    plaintext = _probe(svc, None, module)
    assert plaintext is not None and plaintext.code() == grpc.StatusCode.UNAVAILABLE
    # A client with no certificate at all: TLS with only the CA to check the server by.
    with grpc.secure_channel(
        svc.address,
        grpc.ssl_channel_credentials(secure.tls("client").ca),
        options=[("grpc.ssl_target_name_override", module)],
    ) as channel:
        no_cert = _call(svc, channel)
    assert no_cert is not None and no_cert.code() == grpc.StatusCode.UNAVAILABLE
    # Another CA's certificate for the very same role: the handshake fails.
    foreign = Tls(
        secure.foreign_tls(module).cert, secure.foreign_tls(module).key, secure.tls("client").ca
    )
    refused = _probe(svc, foreign, module)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    log = svc.log()
    assert '"level": "error"' not in log, log[-2000:]


def test_only_the_gateway_may_submit_work_to_the_scheduler(secure: SecureSuite) -> None:
    request = scheduler_pb2.ScheduleRequest(
        request_id="x",
        model="tiny",
        version="v1",
        prompt_token_ids=[5, 6, 7],
        max_tokens=2,
        sampling=common_pb2.SamplingParams(temperature=0, top_p=1),
    )
    for role in ("client", "worker", "registry"):
        with sync_channel(secure.scheduler.address, secure.tls(role), "scheduler") as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=10))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == (
            f"Generate is open to gateway only; this caller's certificate is for {role!r}"
        )
        # Nor may anyone else open a shared token stream (its id admits requests to it).
        with sync_channel(secure.scheduler.address, secure.tls(role), "scheduler") as channel:
            feed = scheduler_pb2_grpc.SchedulerStub(channel).Subscribe(
                scheduler_pb2.SubscribeRequest(), timeout=10
            )
            with pytest.raises(grpc.RpcError) as info:
                next(feed)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == (
            f"Subscribe is open to gateway only; this caller's certificate is for {role!r}"
        )


def test_a_second_run_stream_is_refused_and_the_first_keeps_serving(secure: SecureSuite) -> None:
    # A stream in flight on the scheduler's Run stream while the others try to open theirs.
    auth = (("authorization", f"Bearer {KEY_A}"),)
    stream = Stream(secure.shared.address, "still here?", 900, metadata=auth)
    stream.start()
    until(lambda: len(stream.tokens) >= 4, 60, "the stream to start")
    for role in ("gateway", "client"):  # the wrong role is refused before anything else
        with sync_channel(secure.worker.address, secure.tls(role), "worker") as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(worker_pb2_grpc.WorkerStub(channel).Run(iter([]), timeout=10))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Even the scheduler's own certificate cannot open a second stream beside the first.
    with sync_channel(secure.worker.address, secure.tls("scheduler"), "worker") as channel:
        plan = worker_pb2.StepPlan(step_id=1, dropped_seq_ids=["anything"])
        with pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.WorkerStub(channel).Run(iter([plan]), timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already serves a Run stream" in (info.value.details() or "")
    assert stream.is_alive(), "the stream ended before the attempts: it proves nothing"
    # The scheduler's stream was not replaced: the stream in flight runs to its end on this
    # worker, and new requests run there too.
    stream.join(120)
    assert stream.error is None, stream.error
    assert len(stream.tokens) == 900
    from tests.security.test_identity import _grpc_tokens

    tokens, _ = _grpc_tokens(secure.shared.address, "still here?", KEY_A, "after")
    assert tokens == stream.tokens[:24]
    assert "worker lost" not in secure.scheduler.log()


def test_only_workers_may_register_and_heartbeat(secure: SecureSuite) -> None:
    fake = registry_pb2.RegisterWorkerRequest(
        worker_id="fake", address="127.0.0.1:1", model="tiny", version="v1"
    )
    for role in ("client", "gateway", "scheduler"):
        with sync_channel(secure.registry.address, secure.tls(role), "registry") as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            for call, request in (
                (stub.RegisterWorker, fake),
                (stub.Heartbeat, registry_pb2.HeartbeatRequest(worker_id="worker")),
                (stub.DeregisterWorker, registry_pb2.DeregisterWorkerRequest(worker_id="worker")),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=10)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with sync_channel(secure.registry.address, secure.tls("client"), "registry") as channel:
        listed = next(
            registry_pb2_grpc.RegistryStub(channel).WatchWorkers(
                registry_pb2.WatchWorkersRequest(), timeout=10
            )
        )
    assert [w.worker_id for w in listed.workers] == ["worker"]  # no fake, the real one kept


def test_a_server_on_the_wrong_certificate_is_refused_by_its_clients(secure: SecureSuite) -> None:
    # The registry's certificate presented as a worker's: the scheduler would not trust it.
    with pytest.raises(grpc.RpcError) as info:
        with sync_channel(secure.registry.address, secure.tls("client"), "worker") as channel:
            registry_pb2_grpc.RegistryStub(channel).ListModels(
                registry_pb2.ListModelsRegistryRequest(), timeout=5
            )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("module", ["registry", "scheduler", "worker", "gateway"])
def test_a_service_without_certificates_or_insecure_will_not_start(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )
    assert done.returncode == 2
    assert "no certificates: pass --tls-cert, --tls-key and --tls-ca" in done.stderr
    assert "or --insecure for plaintext" in done.stderr


def test_health_port_answers_probes_in_plaintext(secure: SecureSuite) -> None:
    # Kubelet's grpc probe has no client certificate: the health port needs none, and
    # serves nothing but health.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    db = str(secure.suite.workdir / "probe.db")
    svc = secure.suite.spawn(
        "registry-probe",
        "registry",
        ["--db", db, "--no-register-default", "--health-port", str(port)],
        "canteen.v1.Registry",
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="canteen.v1.Registry"), timeout=5
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            registry_pb2_grpc.RegistryStub(channel).ListModels(
                registry_pb2.ListModelsRegistryRequest(), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert svc.terminate() == 0


def test_the_public_ports_serve_tls_when_given_a_certificate(secure: SecureSuite) -> None:
    certs = secure.certs
    gateway = secure.start_public_tls_gateway("gateway-public-tls")
    credentials = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    with grpc.secure_channel(gateway.address, credentials) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Complete(
            inference_pb2.GenerateRequest(prompt="over TLS", max_tokens=3, temperature=0),
            timeout=60,
            metadata=(("authorization", f"Bearer {KEY_A}"),),
        )
    assert reply.usage.completion_tokens == 3
    with grpc.insecure_channel(gateway.address) as channel:  # plaintext is refused
        with pytest.raises(grpc.RpcError) as info:
            inference_pb2_grpc.InferenceStub(channel).ListModels(
                inference_pb2.ListModelsRequest(), timeout=5
            )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    url = f"https://127.0.0.1:{gateway.http_port}/v1/models"
    listed = httpx.get(
        url, headers={"authorization": f"Bearer {KEY_A}"}, verify=str(certs / "ca.pem")
    )
    assert listed.status_code == 200 and listed.json()["data"][0]["id"].startswith("tiny")
    assert gateway.terminate() == 0


def test_without_keys_the_gateway_binds_loopback_unless_told(secure: SecureSuite) -> None:
    args = [
        sys.executable,
        "-m",
        "gateway",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--http-port",
        "-1",
        "--insecure",
    ]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert (
        "host='0.0.0.0': without API keys the gateway binds loopback only"
        in done.stdout + done.stderr
    )
    assert "--allow-unauthenticated" in done.stdout + done.stderr
