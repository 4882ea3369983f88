"""Faults on a running ``canteen up``: its children are found in its state file and signalled;
its supervisor starts each one again.

    kill-worker:NAME       SIGKILL the worker            restart-worker:NAME   SIGTERM (drain)
    drain-gateway:TARGET   SIGTERM the gateway           restart-gateway:TARGET  the same
    restart-scheduler      SIGTERM the scheduler

A target is a child's name (``worker-1``, ``gateway``) or its address. Each fault returns
once the supervisor has the child running again under a new PID and ready: under ``canteen
up`` every killed or drained service comes back, so chaos then waits for it to serve too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from canteen.tools.up.state import ChildState, SuiteState, is_running, read_state


class UpInjector:
    """The ``FaultInjector`` of a ``canteen up`` whose state file is ``state_file``."""

    def __init__(self, state_file: Path, timeout: float = 120.0) -> None:
        self.state_file, self.timeout = state_file, timeout

    def state(self) -> SuiteState:
        """The suite's state; RuntimeError when no canteen up runs with this state file."""
        state = read_state(self.state_file)
        if state is None or not is_running(state):
            raise RuntimeError(
                f"no running canteen up writes {self.state_file}: start one (canteen up), "
                "or give --on commands for services started another way"
            )
        return state

    def child(self, target: str, role: str) -> ChildState:
        """The child named ``target``, or listening at it; it must have ``role``."""
        state = self.state()
        child = state.child(target) or (state.by_address(target) if ":" in target else None)
        if child is None:
            names = ", ".join(c.name for c in state.children)
            raise RuntimeError(f"{target!r} is no child of this canteen up ({names})")
        kind = child.name.partition("-")[0]  # worker-1 is a worker, gateway-1 a gateway
        if kind != role:
            raise RuntimeError(f"{target!r} is the {kind}, not a {role}")
        return child

    def gateway_address(self, target: str) -> str:
        """``host:port`` of the gateway ``target`` names (clients dial it)."""
        state, child = self.state(), self.child(target, "gateway")
        host = "127.0.0.1" if state.host in ("", "0.0.0.0", "::") else state.host
        return f"{host}:{child.port}"

    def restarts(self) -> dict[str, int]:
        """Restarts per child so far, as the supervisor counts them."""
        return {c.name: c.restarts for c in self.state().children}

    def _signal_and_wait(self, child: ChildState, sig: signal.Signals) -> None:
        """Signals the child's process; returns once a new one is ready."""
        if child.pid is None:
            raise RuntimeError(f"{child.name} has no process now (it is {child.state})")
        os.kill(child.pid, sig)
        deadline = time.monotonic() + self.timeout
        while True:
            now = self.state().child(child.name)
            if now is not None and now.state == "down":
                raise RuntimeError(f"{child.name} stays down after {now.last_exit}")
            if now is not None and now.pid not in (None, child.pid) and now.state == "ready":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not back and ready within {self.timeout:g} s")
            time.sleep(0.1)

    def kill_worker(self, name: str) -> None:
        self._signal_and_wait(self.child(name, "worker"), signal.SIGKILL)

    def restart_worker(self, name: str) -> None:
        self._signal_and_wait(self.child(name, "worker"), signal.SIGTERM)

    def drain_gateway(self, address: str) -> None:
        self._signal_and_wait(self.child(address, "gateway"), signal.SIGTERM)

    def restart_gateway(self, address: str) -> None:
        self._signal_and_wait(self.child(address, "gateway"), signal.SIGTERM)

    def restart_scheduler(self) -> None:
        self._signal_and_wait(self.child("scheduler", "scheduler"), signal.SIGTERM)
