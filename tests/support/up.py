"""``canteen up`` as a test runs it: a process on the tiny model, its data folder in a temp
folder, its stderr in a file, its state file and its client certificate at hand."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc

from canteen.tls import Tls, sync_channel
from canteen.tools.up.state import ChildState, SuiteState, read_state
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.support.suite import free_port

CANTEEN = Path(sys.executable).parent / "canteen"


def free_base_port(span: int = 140) -> int:
    """A base port whose next ``span`` ports are free now."""
    while True:
        base = free_port()
        if base > 65535 - span:
            continue
        try:
            for port in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


class Up:
    """``canteen up --model tiny`` with ``args``; ``start`` returns once it printed ready."""

    def __init__(self, workdir: Path, model_dir: Path, *args: str, base: int = 0) -> None:
        self.workdir, self.base = workdir, base or free_base_port()
        self.data = workdir / "data"
        self.env = {**os.environ, "CANTEEN_DATA_DIR": str(self.data)}
        self.argv = [
            str(CANTEEN),
            "up",
            *("--base-port", str(self.base), "--model", "tiny"),
            *("--add-model", f"tiny:v1={model_dir}", "--db", str(workdir / "registry.db")),
            *("--model-root", str(model_dir.parent)),
            *args,
        ]
        self.stderr_path = workdir / "up.stderr"
        self.process: subprocess.Popen[str] | None = None
        self.ready_lines: list[str] = []

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.base}"

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.base + 1}"

    def start(self, timeout: float = 300) -> Up:
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self.stderr_path.open("w"),
            text=True,
            env=self.env,
        )
        assert self.process.stdout is not None
        first = self.process.stdout.readline()  # blocks until ready, or "" when it exits
        assert first.startswith("Canteen is ready"), (first, self.stderr()[-3000:])
        self.ready_lines = [first]
        while not self.ready_lines[-1].startswith("Try:"):
            self.ready_lines.append(self.process.stdout.readline())
        return self

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def messages(self) -> list[str]:
        """The launcher's own lines (not the children's JSON logs)."""
        return [line for line in self.stderr().splitlines() if line.startswith("canteen")]

    def state(self) -> SuiteState:
        state = read_state(self.data / "suite.json")
        assert state is not None, "no state file"
        return state

    def child(self, name: str) -> ChildState:
        child = self.state().child(name)
        assert child is not None, name
        return child

    def tls(self) -> Tls:
        return Tls.from_folder(self.data / "certs", "client")

    def stats(self) -> dict[str, scheduler_pb2.WorkerStats]:
        """The scheduler's workers, asked with the suite's client certificate; {} when down."""
        with sync_channel(self.scheduler, self.tls(), "scheduler") as channel:
            try:
                reply = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                    scheduler_pb2.GetStatsRequest(), timeout=5
                )
            except grpc.RpcError:
                return {}
        return {w.worker_id: w for w in reply.workers}

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int:
        """Signals the child's current process; its pid."""
        pid = self.child(name).pid
        assert pid is not None, f"{name} has no process: {self.child(name)}"
        os.kill(pid, sig)
        return pid

    def stop(self, timeout: float = 120) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
