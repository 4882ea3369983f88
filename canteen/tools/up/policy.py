"""When a child that exited unasked is started again.

Exponential backoff: the first restart waits ``first_delay``, each next one twice as long, up
to ``max_delay``; a child that was healthy for ``healthy_reset`` seconds starts over at
``first_delay``. A child that exits ``max_exits`` times within ``window`` seconds stays down.
Pure bookkeeping on the times it is given: no clock, no processes.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    first_delay: float = 1.0
    """Seconds before the first restart after a healthy run."""
    max_delay: float = 30.0
    """The longest wait between restarts."""
    healthy_reset: float = 60.0
    """Seconds of readiness after which the backoff starts over."""
    max_exits: int = 5
    """Unasked exits within ``window`` after which the child stays down."""
    window: float = 120.0
    """Seconds over which ``max_exits`` is counted."""

    def __post_init__(self) -> None:
        for name in ("first_delay", "max_delay", "healthy_reset", "window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        if self.max_delay < self.first_delay:
            raise ValueError(f"max_delay={self.max_delay}: must be >= first_delay")
        if self.max_exits < 1:
            raise ValueError(f"max_exits={self.max_exits}: must be >= 1")


@dataclass
class ExitLog:
    """One child's unasked exits; ``record`` says how long to wait before the next start."""

    policy: RestartPolicy
    times: deque[float] = field(default_factory=deque)
    streak: int = 0  # restarts since the last healthy run

    def record(self, now: float, healthy_for: float) -> float | None:
        """An exit at ``now`` after ``healthy_for`` seconds of readiness: the delay before
        the restart, or None when the child stays down."""
        p = self.policy
        if healthy_for >= p.healthy_reset:
            self.streak = 0
        self.times.append(now)
        while self.times and self.times[0] <= now - p.window:
            self.times.popleft()
        if len(self.times) >= p.max_exits:
            return None
        delay: float = min(p.max_delay, p.first_delay * 2.0**self.streak)
        self.streak += 1
        return delay


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` (asyncio reports a signal as -N)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"
