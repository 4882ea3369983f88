"""Chaos for real: greedy load through two gateways while workers are SIGKILLed and restarted,
a gateway drains and comes back and the scheduler restarts. No request may be lost (each one
completes with exactly the fault-free tokens or fails retryably with a prefix of them), no KV
block may leak, and every drained process must exit 0."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from canteen.cli import main
from canteen.tools.chaos import ChaosConfig, Fault, ShellInjector, parse_faults, run_chaos
from canteen.tools.chaos.report import Outcome, Received, Report, classify
from canteen.tools.chaos.runner import Load
from canteen.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.support.suite import Service, Suite, wait_serving
from tests.support.up import CANTEEN, Up

# The default dtype (bfloat16 on AMX/AVX512-BF16 CPUs): exact tokens after a worker dies hold
# in it, since every kernel computes a row the same way in any step (README, Exactness).
WORKER_ARGS = ("--num-kv-blocks=256", "--block-size=8", "--threads=1")
GATEWAY_ARGS = ("--scheduler-retry", "30")


@dataclass
class SuiteFaults:
    """The chaos FaultInjector on ``Suite`` processes: SIGKILL, SIGTERM, ``Suite.restart``."""

    suite: Suite
    registry: Service
    scheduler: Service
    workers: dict[str, Service]
    gateways: dict[str, Service]  # by address
    exit_codes: dict[str, int] = field(default_factory=dict)  # drained processes
    killed_running: dict[str, int] = field(default_factory=dict)  # sequences on a victim

    def kill_worker(self, name: str) -> None:
        with grpc.insecure_channel(self.scheduler.address) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=5
            )
        self.killed_running[name] = sum(w.num_running for w in stats.workers if w.worker_id == name)
        victim = self.workers[name]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)

    def restart_worker(self, name: str) -> None:
        self.workers[name] = self.suite.restart(self.workers[name])

    def drain_gateway(self, address: str) -> None:
        self.exit_codes[f"gateway {address}"] = self.gateways[address].terminate(60)

    def restart_gateway(self, address: str) -> None:
        self.gateways[address] = self.suite.restart(self.gateways[address])

    def restart_scheduler(self) -> None:
        self.exit_codes["scheduler"] = self.scheduler.terminate(60)
        self.scheduler = self.suite.restart(self.scheduler, wait_ready=False)

    def alive(self) -> list[Service]:
        return [self.registry, self.scheduler, *self.workers.values(), *self.gateways.values()]


@pytest.fixture
def faults(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteFaults]:
    s = Suite(tmp_path_factory.mktemp("chaos"))
    try:
        registry = s.start_registry(
            "--no-register-default",
            "--add-model",
            f"tiny:v1={tiny_model_dir}",
            "--default-model",
            "tiny",
            "--lease-ttl",
            "2",
        )
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0", "--failover-wait", "20")
        workers = {
            name: s.start_worker(registry, "tiny", *WORKER_ARGS, name=name)
            for name in ("worker-0", "worker-1")
        }
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateways = [
            s.start_gateway(registry, scheduler, *GATEWAY_ARGS, name=f"gateway-{i}")
            for i in range(2)
        ]
        yield SuiteFaults(s, registry, scheduler, workers, {g.address: g for g in gateways})
    finally:
        s.stop()


@pytest.mark.timeout(400)
def test_no_request_is_lost_and_no_block_leaks_under_faults(
    faults: SuiteFaults, tmp_path: Path
) -> None:
    drained = next(iter(faults.gateways))
    schedule = [
        Fault("kill-worker", "worker-0"),
        Fault("restart-worker", "worker-0"),
        Fault("kill-worker", "worker-1"),
        Fault("restart-worker", "worker-1"),
        Fault("drain-gateway", drained),
        Fault("restart-gateway", drained),
        Fault("restart-scheduler"),
    ]
    config = ChaosConfig(
        gateways=list(faults.gateways),
        scheduler=faults.scheduler.address,
        faults=schedule,
        requests=120,
        concurrency=8,
        max_tokens=(16, 32, 48, 64),
        duration=30.0,
        request_timeout=90.0,
    )
    report = asyncio.run(run_chaos(config, faults))
    print("\n" + report.format())
    data = report.to_dict()
    (tmp_path / "chaos.json").write_text(json.dumps(data, indent=2))

    assert [f.error for f in report.faults] == [""] * len(schedule), report.format()
    assert_the_readme_claim(report, config)
    assert report.leaks == []
    assert all(f.in_flight > 0 for f in report.faults), report.format()
    assert sum(faults.killed_running.values()) > 0, faults.killed_running
    assert faults.exit_codes == {f"gateway {drained}": 0, "scheduler": 0}
    dead = [svc.name for svc in faults.alive() if svc.process.poll() is not None]
    assert dead == []


@pytest.mark.timeout(600)
def test_canteen_chaos_drives_canteen_up(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`canteen chaos` finds the children of a running `canteen up` (mTLS, the default) in its
    state file, kills and drains them, and canteen up's supervisor brings each back."""
    workdir = tmp_path_factory.mktemp("chaos-up")
    up = Up(
        workdir,
        tiny_model_dir,
        "--workers",
        "2",
        *(f"--worker-arg={a}" for a in WORKER_ARGS),
        "--gateway-arg=--scheduler-retry=60",
    ).start()
    try:
        faults = "kill-worker:worker-0,restart-worker:worker-1,drain-gateway:gateway,"
        faults += "restart-scheduler"
        report_path = workdir / "chaos.json"
        done = subprocess.run(
            [
                str(CANTEEN),
                "chaos",
                *("--faults", faults, "--requests", "60", "--concurrency", "4"),
                *("--duration", "10", "--report", str(report_path)),
            ],
            capture_output=True,
            text=True,
            timeout=540,
            env=up.env,
            check=False,
        )
        print(done.stdout, done.stderr[-3000:])
        assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
        data = json.loads(report_path.read_text())
        assert data["lost"] == 0 and data["leaks"] == []
        assert data["completed_exactly"] + data["failed_retryably"] == data["requests"] == 60
        assert [f["error"] for f in data["faults"]] == [""] * 4
        # The supervisor restarted each victim once, and the report counts it.
        restarts = {"worker-0": 1, "worker-1": 1, "gateway": 1, "scheduler": 1}
        assert data["restarts"] == restarts
        assert {c.name: c.restarts for c in up.state().children} == {"registry": 0, **restarts}
        assert {c.state for c in up.state().children} == {"ready"}
    finally:
        assert up.stop() == 0


def assert_the_readme_claim(report: Report, config: ChaosConfig) -> None:
    """Every request completed with exactly the fault-free tokens, or failed with a retryable
    status having sent a prefix of them; none was lost. Checked here from what each request
    received, not from the report's own verdicts; and the requests sent after the last fault
    (on the recovered suite) all completed exactly."""
    assert len(report.outcomes) == config.requests
    for o in report.outcomes:
        exact = (o.code, o.finish) == ("", LENGTH) and o.token_ids == o.reference
        retryable = o.code in config.retryable and o.token_ids == o.reference[: len(o.token_ids)]
        assert exact or retryable, (o.summary(), o.token_ids, o.reference)
        assert o.result == ("exact" if exact else "retryable")
    assert report.to_dict()["lost"] == 0, report.format()
    part = config.requests // (len(config.faults) + 2)
    last = [
        o
        for o in report.outcomes
        if int(o.request_id.rsplit("-", 1)[1]) >= part * (len(config.faults) + 1)
    ]
    assert last and all(o.result == "exact" for o in last), [o.summary() for o in last]


# The judging and the CLI's plumbing, without a suite.

REF = [5, 6, 7, 8]
LENGTH = common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("got", "result"),
    [
        (Received(tokens=REF, finish=LENGTH), "exact"),
        (Received(tokens=REF[:2], code="UNAVAILABLE"), "retryable"),
        (Received(tokens=[], code="RESOURCE_EXHAUSTED"), "retryable"),
        (Received(tokens=[5, 6, 6], code="UNAVAILABLE"), "lost"),  # a repeated token
        (Received(tokens=[5, 9, 7, 8], finish=LENGTH), "lost"),
        (Received(tokens=REF[:3], finish=LENGTH), "lost"),  # missing a token
        (Received(tokens=REF), "lost"),  # no finish_reason
        (Received(tokens=REF[:1], code="INTERNAL"), "lost"),
        (Received(tokens=REF[:1], code="DEADLINE_EXCEEDED"), "lost"),
        (Received(tokens=REF, finish=LENGTH, foreign_id="req-x"), "lost"),
        # CANCELLED before any response header: grpc's shutdown race, no Canteen code saw it
        (Received(tokens=[], code="CANCELLED"), "retryable"),
        (Received(tokens=[], code="CANCELLED", answered=True), "lost"),  # a handler cancelled it
        (Received(tokens=REF[:1], code="CANCELLED", answered=True), "lost"),
    ],
)
def test_classify(got: Received, result: str) -> None:
    assert classify(REF, got, ("UNAVAILABLE", "RESOURCE_EXHAUSTED"))[0] == result


class _Refuser(inference_pb2_grpc.InferenceServicer):
    """Ends every Generate call CANCELLED; after response headers if ``answer``."""

    def __init__(self, answer: bool) -> None:
        self.answer, self.calls = answer, 0

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        if self.answer:
            await context.send_initial_metadata((("x-request-id", "r"),))
        await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        yield inference_pb2.GenerateResponse()  # never reached: makes this a stream handler


@pytest.mark.parametrize(("answer", "attempts"), [(False, 3), (True, 1)])
def test_a_cancelled_call_is_sent_again_only_when_no_handler_answered(
    answer: bool, attempts: int
) -> None:
    """Over real gRPC: CANCELLED without response headers (what a stopping server answers for
    calls still queued, grpc/grpc#41785) is retried like UNAVAILABLE; once the gateway has
    answered, CANCELLED is its verdict and the request is judged as lost."""

    async def run() -> tuple[Outcome, int]:
        server, servicer = grpc.aio.server(), _Refuser(answer)  # type: ignore[abstract]
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                config = ChaosConfig([], "", requests=1, model="m", attempts=3)
                load = Load(config, [_stub(channel)])
                load.refs[load.plan[0]] = REF
                await load.one(0)
                return load.outcomes[0], servicer.calls
        finally:
            await server.stop(0)

    outcome, calls = asyncio.run(run())
    assert calls == attempts
    assert (outcome.result, outcome.code) == ("retryable" if not answer else "lost", "CANCELLED")


def _stub(channel: grpc.aio.Channel) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


def test_parse_faults_and_shell_commands(tmp_path: Path) -> None:
    assert parse_faults("kill-worker:w0, drain-gateway:127.0.0.1:1,restart-scheduler") == [
        Fault("kill-worker", "w0"),
        Fault("drain-gateway", "127.0.0.1:1"),
        Fault("restart-scheduler"),
    ]
    for bad in ("explode:w0", "kill-worker"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"kinds are|use kill-worker:TARGET"):
            parse_faults(bad)
    out = tmp_path / "out"
    shell = ShellInjector({"kill-worker": f"echo {{target}} $CHAOS_TARGET > {out}"})
    shell.kill_worker("it's")
    assert out.read_text() == "it's it's\n"
    with pytest.raises(RuntimeError, match="exited 3"):
        ShellInjector({"restart-scheduler": "exit 3"}).restart_scheduler()


ON_SCHED = "restart-scheduler=true"


def test_cli_refuses_a_fault_without_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--faults", "kill-worker:w0", "--on", "restart-worker=true"])
    assert exit_info.value.code == 2
    assert "no --on command for kill-worker" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--requests", "10", "--faults", "restart-scheduler", "--on", ON_SCHED])
    assert exit_info.value.code == 2
    assert "too few" in capsys.readouterr().err
