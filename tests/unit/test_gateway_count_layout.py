"""``canteen up --gateways N``: the ports and flags of gateway processes sharing one port."""

from __future__ import annotations

import pytest

from canteen.tools.up.gateways import share_rate_limits
from canteen.tools.up.layout import SuiteLayout, plan_children


def _flag(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_gateways_share_the_public_ports_and_each_has_its_own_health_and_metrics() -> None:
    layout = SuiteLayout(base_port=7000, num_workers=2, num_gateways=3, insecure=True)
    specs = {c.name: c for c in plan_children(layout)}
    names = ["registry", "scheduler", "worker-0", "worker-1", "gateway-0", "gateway-1"]
    assert list(specs) == [*names, "gateway-2"]
    gateways = [specs[f"gateway-{i}"] for i in range(3)]
    assert [g.port for g in gateways] == [7000, 7000, 7000]
    assert [g.metrics_port for g in gateways] == [7005, 7146, 7147]
    assert [g.health_port for g in gateways] == [7138, 7139, 7140]
    for g in gateways:
        assert g.argv[1:3] == ("-m", "gateway") and g.role == "gateway" and g.is_public
        assert "--reuse-port" in g.argv
        assert _flag(g.argv, "--http-port") == ["7006"]
        assert _flag(g.argv, "--health-port") == [str(g.health_port)]
        assert _flag(g.argv, "--metrics-port") == [str(g.metrics_port)]
    ports = layout.all_ports()
    assert len(set(ports)) == len(ports) and 7000 in ports and 7140 in ports and 7147 in ports
    # Every port of the widest suite stays within 65535.
    widest = SuiteLayout(base_port=65535 - 153, num_workers=64, num_gateways=8)
    assert max(widest.all_ports()) <= 65535


def test_one_gateway_keeps_its_name_ports_and_flags() -> None:
    gateway = plan_children(SuiteLayout(base_port=7000, insecure=True))[-1]
    assert (gateway.name, gateway.port, gateway.metrics_port) == ("gateway", 7000, 7005)
    assert gateway.health_port == -1
    assert "--reuse-port" not in gateway.argv and "--health-port" not in gateway.argv


@pytest.mark.parametrize("count", [0, 9])
def test_a_gateway_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ValueError, match=rf"gateways={count}: must be in 1\.\.8"):
        SuiteLayout(num_gateways=count)


def test_per_key_limits_are_divided_among_the_gateways() -> None:
    args = ["--rate-limit-rpm", "60", "--rate-limit-tpm=1000", "--grace=5"]
    assert share_rate_limits(args, 2, {}) == [
        *args,
        "--rate-limit-rpm=30",
        "--rate-limit-tpm=500",
    ]
    # The last flag wins, as in the gateway; a limit below N still allows one per process.
    assert share_rate_limits(["--rate-limit-rpm=9", "--rate-limit-rpm=2"], 3, {})[-1] == (
        "--rate-limit-rpm=1"
    )
    # The variables count when no flag is given; 0 stays unlimited.
    env = {"CANTEEN_RATE_LIMIT_RPM": "100", "CANTEEN_RATE_LIMIT_TPM": "0"}
    assert share_rate_limits([], 4, env) == ["--rate-limit-rpm=25"]
    with pytest.raises(ValueError, match=r"rate-limit-tpm='lots': must be an integer"):
        share_rate_limits(["--rate-limit-tpm=lots"], 2, {})


def test_the_gateways_rate_limits_in_their_command_lines() -> None:
    layout = SuiteLayout(num_gateways=2, insecure=True, gateway_args=["--rate-limit-rpm=60"])
    for spec in plan_children(layout)[-2:]:
        assert spec.argv[-2:] == ("--rate-limit-rpm=60", "--rate-limit-rpm=30")
