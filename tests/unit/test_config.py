"""Service configuration from flags, CANTEEN_* variables and dataclass defaults."""

from __future__ import annotations

import pytest

from canteen.config import parse_bytes, parse_config
from registry.config import RegistryConfig
from scheduler.config import SchedulerConfig


def test_defaults_when_no_flag_or_variable() -> None:
    config = parse_config(SchedulerConfig, [], env={})
    assert config == SchedulerConfig()
    assert config.max_queue == 1024 and config.port == 50052


def test_environment_variable_is_read() -> None:
    config = parse_config(SchedulerConfig, [], env={"CANTEEN_MAX_QUEUE": "7"})
    assert config.max_queue == 7


def test_flag_beats_environment_beats_default() -> None:
    env = {"CANTEEN_MAX_QUEUE": "7", "CANTEEN_GRACE": "2.5"}
    config = parse_config(SchedulerConfig, ["--max-queue", "5"], env=env)
    assert config.max_queue == 5  # flag over env
    assert config.grace == 2.5  # env over default
    assert config.max_num_seqs == 256  # default


def test_unrelated_environment_is_ignored() -> None:
    config = parse_config(SchedulerConfig, [], env={"MAX_QUEUE": "3", "CANTEEN_OTHER": "x"})
    assert config.max_queue == 1024


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, True),
        ([], {"CANTEEN_REGISTER_DEFAULT": "false"}, False),
        (["--no-register-default"], {"CANTEEN_REGISTER_DEFAULT": "yes"}, False),
        (["--register-default"], {"CANTEEN_REGISTER_DEFAULT": "0"}, True),
    ],
)
def test_boolean_flags_and_variables(argv: list[str], env: dict[str, str], expected: bool) -> None:
    assert parse_config(RegistryConfig, argv, env=env).register_default is expected


def test_bad_bound_exits_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(SchedulerConfig, ["--max-queue", "0"], env={})
    assert exc.value.code == 2
    assert "max_queue=0: must be >= 1" in capsys.readouterr().err


def test_bad_bound_from_environment_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(RegistryConfig, [], env={"CANTEEN_LEASE_TTL": "-1"})
    assert "lease_ttl=-1.0: must be > 0" in capsys.readouterr().err


def test_unparsable_value_exits_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(SchedulerConfig, [], env={"CANTEEN_PORT": "http"})
    err = capsys.readouterr().err
    assert "port:" in err and "'http'" in err


def test_unparsable_boolean_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(RegistryConfig, [], env={"CANTEEN_REGISTER_DEFAULT": "maybe"})
    assert "register_default: not a boolean: 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1000", 1000),
        ("4kib", 4096),
        ("1.5GiB", 3 * 2**29),
        ("3 MB", 3_000_000),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "12 parsecs", "-1GiB", "GiB"])
def test_parse_bytes_rejects_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes(text)


def test_parse_bytes_is_exact_and_refuses_fractions_of_a_byte() -> None:
    assert parse_bytes("9007199254740993") == 9007199254740993
    assert parse_bytes("1.5GiB") == 3 * 2**29
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_bytes("1.5")
