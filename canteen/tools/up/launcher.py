"""The suite: one ``Supervised`` child per service, started together, stopped in order.

``run`` locks the data folder (one suite per folder: its certificates, admin key and state
file), makes a throwaway CA, starts every child, and waits until each has been ready once.
Then it serves until Ctrl-C or SIGTERM, or until a child the suite cannot do without stays
down: the registry, the scheduler, the gateway, or the last worker. Stopping drains the
gateway first and the registry last. The state file follows every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from canteen.certs import make_suite_certs
from canteen.local import certs_dir, data_dir, ensure_admin_key
from canteen.tls import Tls
from canteen.tools.up.layout import SuiteLayout, plan_children
from canteen.tools.up.policy import RestartPolicy
from canteen.tools.up.state import SuiteState, is_running, read_state
from canteen.tools.up.supervisor import Supervised

STOP_ORDER = ("gateway", "scheduler", "worker", "registry")


def say(text: str) -> None:
    """One line to stderr in one write, so a child's log line cannot land inside it."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class SuiteBusyError(Exception):
    """Another ``canteen up`` holds the data folder."""


@contextlib.contextmanager
def folder_lock(folder: Path, state_file: Path) -> Iterator[None]:
    """Holds DATA/up.lock for the suite's life; the kernel frees it if the launcher dies."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "up.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = read_state(state_file)
            who = (
                f"pid {other.pid}, gateway port {other.base_port}"
                if other and is_running(other)
                else "another process"
            )
            raise SuiteBusyError(
                f"another canteen up ({who}) uses the data folder {folder}; stop it, or give "
                f"this suite a folder and ports of its own: CANTEEN_DATA_DIR=DIR canteen up "
                f"--base-port PORT"
            ) from None
        yield


class Launcher:
    def __init__(
        self,
        layout: SuiteLayout,
        policy: RestartPolicy | None = None,
        stop_grace: float = 40.0,
    ) -> None:
        self.layout = layout
        self.policy = policy or RestartPolicy()
        self.stop_grace = stop_grace
        self.state_file = Path(layout.state_file) if layout.state_file else None
        self.children: list[Supervised] = []
        self.fatal = ""  # why the suite must stop, once a child it needs stays down
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self.state = SuiteState(
            os.getpid(), layout.base_port, layout.http, layout.host, layout.insecure
        )

    def _prepare_security(self) -> Tls | None:
        """A fresh throwaway CA and certificates (mTLS): one per role and one per worker,
        signed by a CA whose key lives in memory here and is dropped once they are made
        (no child can mint a certificate); and the registry's admin key."""
        ensure_admin_key()
        folder = certs_dir()
        shutil.rmtree(folder, ignore_errors=True)  # keys are never written over old files
        if self.layout.insecure:
            return None  # and CLI tools must not try TLS
        workers = [name for name in self.layout.names() if name.startswith("worker-")]
        hosts = ["localhost", "127.0.0.1", self.layout.host]
        make_suite_certs(folder, hosts, workers=workers, keep_ca_key=False)
        return Tls.from_folder(folder, "client")

    async def run(self, ready_timeout: float) -> int:
        try:
            with folder_lock(data_dir(), self.state_file or data_dir() / "suite.json"):
                return await self._run(ready_timeout)
        except SuiteBusyError as exc:
            say(f"canteen: {exc}")
            return 1

    async def _run(self, ready_timeout: float) -> int:
        tls = self._prepare_security()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.children = [
            Supervised(spec, self.policy, tls, env, self._on_change, say, self.stop_grace)
            for spec in plan_children(self.layout)
        ]
        self.state.children = [c.state for c in self.children]
        tasks = [asyncio.create_task(c.run(), name=c.spec.name) for c in self.children]
        for task in tasks:
            task.add_done_callback(self._on_task_done)
        code = await self._serve(ready_timeout)
        self.state.state = "stopping"
        self._write_state()
        await self._stop_all(tasks)
        self.state.state = "failed" if code else "stopped"
        self.state.message = self.fatal
        self._write_state()
        say("canteen: stopped; restarts: " + self._restarts())
        return code

    async def _serve(self, ready_timeout: float) -> int:
        """Until a stop request (0) or a failure (1)."""
        try:
            await self._until(
                lambda: all(c.ever_ready or c.is_down for c in self.children), ready_timeout
            )
        except TimeoutError:
            waiting = [c.spec.name for c in self.children if not (c.ever_ready or c.is_down)]
            self.fatal = f"not ready within {ready_timeout:g} s: {', '.join(waiting)}"
        if not self._stop.is_set() and not self.fatal:
            self.state.state = "ready"
            self._write_state()
            self._print_endpoints()
            await self._until(lambda: False, None)
        if self.fatal:
            say(f"canteen: {self.fatal}; stopping the suite")
            return 1
        return 0

    async def _until(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Until ``done()``, a stop request or a fatal failure; TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            while not (done() or self._stop.is_set() or self.fatal):
                self._changed.clear()
                await self._changed.wait()

    def _on_signal(self) -> None:
        self._stop.set()
        self._changed.set()

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fatal = f"supervising {task.get_name()} failed: {task.exception()!r}"
            self._changed.set()

    def _on_change(self, child: Supervised) -> None:
        if child.is_down and self.state.state != "stopping":
            self._check_down(child)
        self._write_state()
        self._changed.set()

    def _check_down(self, child: Supervised) -> None:
        name, role = child.spec.name, child.spec.role
        peers = [c for c in self.children if c.spec.role == role]
        if len(peers) == 1 and role != "worker":
            self.fatal = f"{name} stays down and the suite cannot serve without it"
            return
        left = [c for c in peers if not c.is_down]
        if not left:
            self.fatal = f"every {role} stays down: nothing can serve requests"
        else:
            say(
                f"canteen: the suite carries on without {name} ({len(left)} of "
                f"{len(peers)} {role}s left)"
            )

    def _write_state(self) -> None:
        if self.state_file is not None:
            self.state.write(self.state_file)

    def _restarts(self) -> str:
        return ", ".join(f"{c.spec.name} {c.state.restarts}" for c in self.children)

    async def _stop_all(self, tasks: list[asyncio.Task[None]]) -> None:
        """Gateway first, registry last; each drains (SIGTERM) within the grace."""
        for child in self.children:
            child.hold()
        by_task = dict(zip(self.children, tasks, strict=True))
        for kind in STOP_ORDER:
            group = [c for c in self.children if c.spec.role == kind]
            for child in group:
                child.request_stop()
            await asyncio.gather(*(by_task[c] for c in group), return_exceptions=True)

    def _print_endpoints(self) -> None:
        lay = self.layout
        http = (
            [
                f"  http      http://{lay.host}:{lay.http}/v1  (OpenAI-compatible)",
                f"  status    http://{lay.host}:{lay.http}/status  (live batch, KV map, services)",
            ]
            if lay.http >= 0
            else []
        )
        lines = [
            "Canteen is ready:",
            f"  gateway   {lay.host}:{lay.port('gateway')}  (canteen.v1.Inference)",
            *http,
            *self._gateway_lines(),
            f"  scheduler 127.0.0.1:{lay.port('scheduler')}",
            f"  registry  127.0.0.1:{lay.port('registry')}",
            *(f"  {n:<9} 127.0.0.1:{lay.port(n)}" for n in lay.names() if n.startswith("worker")),
            "Metrics: http://127.0.0.1:PORT/metrics on "
            + ", ".join(f"{n} {lay.metrics_port(n)}" for n in lay.names()),
            f"State: {self.state_file}" if self.state_file else "State: not written",
            f"Try: canteen generate --chat 'Hello!' --address 127.0.0.1:{lay.port('gateway')} "
            "--insecure",
        ]
        print("\n".join(lines), flush=True)

    def _gateway_lines(self) -> list[str]:
        """One line per gateway process when several share the public ports."""
        if self.layout.num_gateways == 1:
            return []
        return [
            f"  {c.spec.name:<9} pid {c.state.pid}, health 127.0.0.1:{c.spec.health_port}  "
            "(shares the gateway ports)"
            for c in self.children
            if c.spec.role == "gateway"
        ]
