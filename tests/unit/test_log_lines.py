"""Processes that share one stderr (``canteen up`` and its children, a container's log)
write each line whole: a line is one write, so another process's line never lands inside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LINES = 2000

_SERVICE = """
import sys
from canteen.logging import configure_logging, get_logger
configure_logging(sys.argv[1])
log = get_logger("lines")
for i in range({n}):
    log.info("a line", number=i, padding="x" * 120)
"""

_LAUNCHER = """
from canteen.tools.up.launcher import say
for i in range({n}):
    say(f"canteen: line {{i}} of the launcher " + "y" * 120)
"""


def test_lines_of_processes_sharing_stderr_never_interleave(tmp_path: Path) -> None:
    out = tmp_path / "shared.stderr"
    with out.open("w") as shared:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SERVICE.format(n=LINES), f"service-{i}"], stderr=shared
            )
            for i in range(2)
        ]
        procs.append(
            subprocess.Popen([sys.executable, "-c", _LAUNCHER.format(n=LINES)], stderr=shared)
        )
        assert [p.wait(120) for p in procs] == [0, 0, 0]
    lines = out.read_text().splitlines()
    assert len(lines) == 3 * LINES
    launcher = [line for line in lines if line.startswith("canteen: line ")]
    services = [json.loads(line) for line in lines if not line.startswith("canteen: ")]
    assert len(launcher) == LINES and all(line.endswith("y" * 120) for line in launcher)
    assert sorted(e["service"] for e in services) == ["service-0"] * LINES + ["service-1"] * LINES
