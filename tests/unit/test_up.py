"""``canteen up`` without processes: the restart policy, the port plan, the state file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from canteen.tools.up.layout import SuiteLayout, plan_children
from canteen.tools.up.policy import ExitLog, RestartPolicy, describe_exit
from canteen.tools.up.state import ChildState, SuiteState, is_running, read_state


def test_backoff_doubles_up_to_the_cap_and_starts_over_after_a_healthy_minute() -> None:
    log = ExitLog(RestartPolicy(first_delay=1, max_delay=4, max_exits=100, window=120))
    delays = [log.record(now=100.0 * i, healthy_for=0) for i in range(5)]
    assert delays == [1, 2, 4, 4, 4]
    assert log.record(now=600, healthy_for=60) == 1  # a minute of health: back to the start
    assert log.record(now=700, healthy_for=59) == 2


def test_the_fifth_exit_within_two_minutes_keeps_the_child_down() -> None:
    log = ExitLog(RestartPolicy())
    assert [log.record(now=t, healthy_for=0) for t in (0, 10, 20, 30)] == [1, 2, 4, 8]
    assert log.record(now=119, healthy_for=0) is None


def test_exits_spread_over_more_than_two_minutes_keep_being_restarted() -> None:
    log = ExitLog(RestartPolicy())
    for t in range(0, 1000, 31):  # never 5 within 120 s
        assert log.record(now=t, healthy_for=0) is not None


@pytest.mark.parametrize(
    ("field", "value"), [("first_delay", 0), ("max_exits", 0), ("window", -1), ("max_delay", 0.5)]
)
def test_a_bad_policy_names_the_field(field: str, value: float) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**kwargs)


def test_exits_are_described_by_code_or_signal() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"


def test_the_base_port_moves_every_port_the_http_one_included() -> None:
    a, b = SuiteLayout(num_workers=3), SuiteLayout(base_port=6000, num_workers=3)
    assert a.http == 50051 + 6 and b.http == 6006
    assert [p - 50051 for p in a.all_ports()] == [p - 6000 for p in b.all_ports()]
    assert len(set(a.all_ports())) == len(a.all_ports())  # no port twice
    assert SuiteLayout(base_port=6000, http_port=8080).http == 8080
    assert SuiteLayout(http_port=-1).all_ports() == SuiteLayout(http_port=-1).all_ports()
    assert SuiteLayout(http_port=-1).http not in SuiteLayout(http_port=-1).all_ports()
    # Two suites 140 ports apart share nothing.
    far = SuiteLayout(base_port=50051 + 140, num_workers=64)
    assert not set(SuiteLayout(num_workers=64).all_ports()) & set(far.all_ports())
    with pytest.raises(ValueError, match="base_port=65500"):
        SuiteLayout(base_port=65500)


def _flag(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_pass_through_flags_reach_their_children_last() -> None:
    layout = SuiteLayout(
        base_port=7000,
        num_workers=2,
        insecure=True,
        worker_args=["--threads=1"],
        scheduler_args=["--max-queue", "9"],
        gateway_args=["--http-port", "9999"],
        registry_args=["--lease-ttl=3"],
        state_file="/tmp/s.json",
    )
    by_name = {c.name: c for c in plan_children(layout)}
    assert list(by_name) == ["registry", "scheduler", "worker-0", "worker-1", "gateway"]
    assert by_name["scheduler"].argv[-2:] == ("--max-queue", "9")
    assert by_name["registry"].argv[-1] == "--lease-ttl=3"
    assert all(by_name[w].argv[-1] == "--threads=1" for w in ("worker-0", "worker-1"))
    gateway = by_name["gateway"].argv
    assert _flag(gateway, "--http-port") == ["7006", "9999"]  # the last one wins
    assert _flag(gateway, "--suite-state") == ["/tmp/s.json"]
    assert _flag(by_name["worker-1"].argv, "--port") == ["7011"]
    assert _flag(by_name["worker-1"].argv, "--metrics-port") == ["7075"]
    assert "--insecure" in by_name["worker-1"].argv


def test_the_state_file_round_trips_and_knows_a_dead_launcher(tmp_path: Path) -> None:
    path = tmp_path / "suite.json"
    state = SuiteState(pid=2**22 + 12345, base_port=7000, http_port=7006, host="h", insecure=False)
    state.children = [ChildState("worker-0", 7010, 7074, pid=42, restarts=2, state="ready")]
    state.write(path)
    back = read_state(path)
    assert back is not None and back.child("worker-0") == state.children[0]
    assert back.by_address("127.0.0.1:7010") == state.children[0]
    assert not is_running(back)  # no process has that pid
    assert read_state(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{")
    assert read_state(tmp_path / "bad.json") is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
