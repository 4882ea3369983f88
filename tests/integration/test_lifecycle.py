"""Cancellation, health, reflection, API keys and SIGTERM drains, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from canteen.tls import Tls
from canteen.v1 import common_pb2, inference_pb2, inference_pb2_grpc, scheduler_pb2
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite
from tests.support.suite import Suite, wait_serving


def _stats(suite: TinySuite) -> scheduler_pb2.WorkerStats:
    stats: scheduler_pb2.GetStatsResponse = suite.scheduler_stub.GetStats(
        scheduler_pb2.GetStatsRequest(), timeout=10
    )
    (worker,) = stats.workers
    return worker


def _wait_all_free(suite: TinySuite, timeout: float = 10.0) -> scheduler_pb2.WorkerStats:
    deadline = time.monotonic() + timeout
    while True:
        worker = _stats(suite)
        if worker.num_free_blocks == NUM_KV_BLOCKS and worker.num_running == 0:
            return worker
        if time.monotonic() > deadline:
            return worker
        time.sleep(0.05)


def test_cancelled_stream_frees_its_blocks_and_spares_the_others(suite: TinySuite) -> None:
    other_req = inference_pb2.GenerateRequest(
        prompt="Once upon a time", max_tokens=60, temperature=0, ignore_eos=True
    )
    expected = [t for m in suite.inference.Generate(other_req, timeout=60) for t in m.token_ids]
    result: list[int] = []
    other = threading.Thread(
        target=lambda: result.extend(
            t for m in suite.inference.Generate(other_req, timeout=60) for t in m.token_ids
        )
    )
    other.start()
    victim = suite.inference.Generate(
        inference_pb2.GenerateRequest(
            prompt="The capital of France", max_tokens=500, temperature=0, ignore_eos=True
        ),
        timeout=60,
    )
    for _, _message in zip(range(3), victim, strict=False):
        pass
    assert _stats(suite).num_free_blocks < NUM_KV_BLOCKS
    victim.cancel()
    other.join(60)
    assert result == expected
    worker = _wait_all_free(suite)
    assert (worker.num_free_blocks, worker.num_running, worker.num_waiting) == (NUM_KV_BLOCKS, 0, 0)


def test_all_servers_report_health_and_reflection(suite: TinySuite) -> None:
    for svc in (suite.registry, suite.scheduler, suite.worker, suite.gateway):
        with grpc.insecure_channel(svc.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", svc.service):
                status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.SERVING, (svc.name, name)
        grpcurl = Path(sys.executable).parent / "grpcurl"
        listed = subprocess.run(
            [str(grpcurl), "-plaintext", svc.address, "list"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert svc.service in listed.split() and "grpc.health.v1.Health" in listed.split()


def test_api_keys_guard_the_gateway(suite: TinySuite, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsecret-one\nsecret-two\n")
    gateway = suite.suite.start_gateway(
        suite.registry,
        suite.scheduler,
        "--host",
        "127.0.0.1",
        "--api-keys-file",
        str(keys),
        name="gateway-keys",
    )
    request = inference_pb2.GenerateRequest(prompt="a", max_tokens=2)
    with grpc.insecure_channel(gateway.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for metadata, message in [
            ((), "missing authorization"),
            ((("authorization", "Bearer wrong"),), "invalid API key"),
            ((("authorization", "secret-one"),), "must be 'Bearer KEY'"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, metadata=metadata, timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in info.value.details()
        ok = list(
            stub.Generate(request, metadata=(("authorization", "Bearer secret-two"),), timeout=30)
        )
        assert ok[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert gateway.terminate() == 0


def test_gateway_sigterm_finishes_streams_refuses_new_work_and_exits_0(suite: TinySuite) -> None:
    gateway = suite.suite.start_gateway(
        suite.registry, suite.scheduler, "--grace", "30", name="gateway-drain"
    )
    with grpc.insecure_channel(gateway.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stream = stub.Generate(
            inference_pb2.GenerateRequest(
                prompt="Once upon a time", max_tokens=150, temperature=0, ignore_eos=True
            ),
            timeout=120,
        )
        first = next(stream)
        gateway.process.send_signal(15)
        deadline = time.monotonic() + 10
        while (
            health.Check(health_pb2.HealthCheckRequest(service=gateway.service), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(inference_pb2.GenerateRequest(prompt="a", max_tokens=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 150
    assert gateway.process.wait(60) == 0


def test_worker_refuses_weights_whose_checksum_changed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import shutil

    copy = tmp_path / "tiny-copy"
    shutil.copytree(tiny_model_dir, copy)
    s = Suite(tmp_path)
    try:
        registry = s.start_registry("--no-register-default", "--add-model", f"t2:v1={copy}")
        weights = copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        with pytest.raises(RuntimeError) as info:
            s.start_worker(registry, "t2", "--num-kv-blocks", "8", "--threads", "1")
        assert "checksum mismatch" in str(info.value)
        assert s.services[-1].process.wait(30) == 2
    finally:
        s.stop()


def test_unknown_model_worker_exits_with_a_message(tmp_path: Path) -> None:
    s = Suite(tmp_path)
    try:
        registry = s.start_registry("--no-register-default")
        with pytest.raises(RuntimeError) as info:
            s.start_worker(registry, "ghost", "--threads", "1")
        assert "model 'ghost' is not registered" in str(info.value)
    finally:
        s.stop()


def test_canteen_up_serves_and_stops_cleanly(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.support.metrics import scrape, value
    from tests.support.suite import free_port

    base = free_port()
    while base > 65000 - 20:
        base = free_port()
    canteen = Path(sys.executable).parent / "canteen"
    http_port = free_port()
    # canteen up keeps its certificates and admin key here; the CLI finds them here too.
    env = {**os.environ, "CANTEEN_DATA_DIR": str(tmp_path / "data")}
    up = subprocess.Popen(
        [
            str(canteen),
            "up",
            "--base-port",
            str(base),
            "--http-port",
            str(http_port),
            "--workers",
            "2",
            "--model",
            "tiny",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
            "--db",
            str(tmp_path / "r.db"),
            "--worker-arg=--num-kv-blocks=32",
            "--worker-arg=--threads=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline() for _ in range(1)]
        assert lines[0].startswith("Canteen is ready"), lines
        wait_serving(f"127.0.0.1:{base}", "canteen.v1.Inference", 60)
        out = subprocess.run(
            [
                str(canteen),
                "generate",
                "The capital",
                "--max-tokens",
                "5",
                "--temperature",
                "0",
                "--ignore-eos",
                "--address",
                f"127.0.0.1:{base}",
                "--insecure",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "finish=length" in out.stderr and "completion_tokens=5" in out.stderr
        # The internal ports run on mutual TLS with the suite's throwaway CA.
        client = Tls.from_folder(tmp_path / "data" / "certs", "client")
        for port in (base + 10, base + 11):
            wait_serving(f"127.0.0.1:{port}", "canteen.v1.Worker", 10, tls=client, role="worker")
        with pytest.raises(TimeoutError):
            wait_serving(f"127.0.0.1:{base + 1}", "", 2)  # plaintext: the handshake fails
        listed = subprocess.run(
            [str(canteen), "models", "--registry", f"127.0.0.1:{base + 2}", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert listed.returncode == 0, listed.stderr
        assert "tiny:v1" in listed.stdout
        openai_client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x")
        reply = openai_client.completions.create(model="tiny", prompt="The capital", max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        # Every child serves metrics on its planned port; the gateway on its HTTP port too.
        scheduler = scrape(f"http://127.0.0.1:{base + 3}/metrics")
        assert value(scheduler, "canteen_worker_ready") == 2
        worker_1 = scrape(f"http://127.0.0.1:{base + 75}/metrics")
        assert value(worker_1, "canteen_worker_kv_cache_bytes") > 0
        gateway = scrape(f"http://127.0.0.1:{http_port}/metrics")
        assert value(gateway, "canteen_requests_total", status="OK") == 2
    finally:
        up.send_signal(15)
        code = up.wait(90)
    assert code == 0


def test_readiness_waits_for_a_worker_and_requests_get_unavailable(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    s = Suite(tmp_path)
    try:
        registry = s.start_registry(
            "--no-register-default", "--add-model", f"t3:v1={tiny_model_dir}"
        )
        scheduler = s.start_scheduler(registry)
        gateway = s.spawn(
            "gateway",
            "gateway",
            ["--registry", registry.address, "--scheduler", scheduler.address],
            "canteen.v1.Inference",
            wait_ready=False,
        )
        for svc in (scheduler, gateway):
            with grpc.insecure_channel(svc.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                live = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                ready = stub.Check(health_pb2.HealthCheckRequest(service=svc.service), timeout=5)
                assert live.status == health_pb2.HealthCheckResponse.SERVING
                assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING, svc.name
        with grpc.insecure_channel(gateway.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            deadline = time.monotonic() + 30
            while True:  # the gateway's model table arrives over the registry watch
                try:
                    stub.Complete(inference_pb2.GenerateRequest(prompt="a", model="t3"), timeout=10)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline:
                        time.sleep(0.1)
                        continue
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    assert "no ready worker serves model 't3:v1'" in exc.details()
                    break
                raise AssertionError("a request without a worker succeeded")
    finally:
        s.stop()
