"""The state file of a running ``canteen up``: DATA/suite.json.

The launcher rewrites it (atomically) on every change: a child started, ready, exited,
waiting to restart, down for good; the suite starting, ready, stopping, stopped. The gateway's
``/status`` shows it (``--suite-state``), ``canteen chaos`` finds the children to kill in it.

    {"pid": 4242, "state": "ready", "base_port": 50051, "http_port": 50057, ...,
     "children": [{"name": "worker-0", "pid": 4250, "port": 50061, "state": "ready",
                   "restarts": 1, "last_exit": "killed by SIGKILL", ...}, ...]}
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canteen.local import data_dir

# A child's states. "down": it exited too often and stays down; "backoff": waiting to restart.
CHILD_STATES = ("starting", "ready", "not-ready", "backoff", "down", "stopping", "stopped")
SUITE_STATES = ("starting", "ready", "stopping", "stopped", "failed")


def state_path() -> Path:
    return data_dir() / "suite.json"


@dataclass
class ChildState:
    name: str
    port: int
    metrics_port: int
    health_port: int = -1  # its own health port when it shares ``port`` (gateway-i)
    pid: int | None = None
    state: str = "starting"
    restarts: int = 0  # times the supervisor started it again
    last_exit: str = ""  # how its last run ended: "exit code 1", "killed by SIGKILL"
    since: float = field(default_factory=time.time)  # when it entered this state (epoch s)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class SuiteState:
    pid: int  # the launcher's
    base_port: int
    http_port: int
    host: str
    insecure: bool
    state: str = "starting"
    message: str = ""  # why the suite stopped, when it failed
    children: list[ChildState] = field(default_factory=list)
    updated: float = field(default_factory=time.time)

    def child(self, name: str) -> ChildState | None:
        return next((c for c in self.children if c.name == name), None)

    def by_address(self, address: str) -> ChildState | None:
        """The child listening at ``HOST:PORT`` (its gRPC port)."""
        port = address.rpartition(":")[2]
        return next((c for c in self.children if str(c.port) == port), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SuiteState:
        children = [ChildState(**c) for c in data.get("children", [])]
        return cls(**{**data, "children": children})

    def write(self, path: Path) -> None:
        """Replaces the file at once: a reader never sees half of it."""
        self.updated = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def read_state(path: Path) -> SuiteState | None:
    """The state in ``path``; None when there is none or it cannot be read."""
    try:
        return SuiteState.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def is_running(state: SuiteState) -> bool:
    """Whether the launcher that wrote ``state`` still runs."""
    if state.state in ("stopped", "failed"):
        return False
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
