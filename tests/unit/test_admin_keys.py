"""Admin key scopes: the file format and what each scope may do."""

from __future__ import annotations

from pathlib import Path

import pytest

from canteen.admin_keys import WRITE, AdminKeys, ScopeError
from canteen.auth import AuthenticationError, key_id


def _keys(tmp_path: Path, text: str) -> AdminKeys:
    path = tmp_path / "admin-keys"
    path.write_text(text)
    return AdminKeys.load(str(path), "")


def test_a_read_key_is_refused_a_write_and_a_write_key_is_not(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "# ops\nops-key scope=write\nstatus-key scope=read\nold-key\n")
    with pytest.raises(ScopeError) as info:
        keys.authorize("Bearer status-key", "AddModel", WRITE)
    assert str(info.value) == (
        f"admin key {key_id('status-key')} has scope=read: AddModel needs an admin key with "
        "scope=write"
    )
    assert keys.authorize("Bearer ops-key", "AddModel", WRITE).key_id == key_id("ops-key")
    # A line without scope= is a write key, as every keys file was before scopes.
    assert keys.key_ids(WRITE) == [key_id("ops-key"), key_id("old-key")]
    with pytest.raises(AuthenticationError, match="invalid API key"):
        keys.authorize("Bearer guess", "AddModel", WRITE)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("k scope=admin", "line 1: scope='admin': must be read or write"),
        ("k rpm=5", "line 1: the only option of an admin key is scope=read or scope=write"),
    ],
)
def test_a_bad_scope_names_the_file_line_and_rule(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        _keys(tmp_path, line + "\n")
    assert str(info.value) == f"admin_keys_file={str(tmp_path / 'admin-keys')!r} {message}"


def test_one_key_with_two_scopes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="listed with both scope=read and write"):
        _keys(tmp_path, "k scope=read\nk scope=write\n")


def test_the_gateway_names_the_write_keys_it_is_given(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    from canteen.config import parse_config
    from gateway.__main__ import load_admin_keys
    from gateway.config import GatewayConfig

    path = tmp_path / "status-keys"
    path.write_text("status-key scope=read\n")
    config = parse_config(GatewayConfig, ["--admin-keys-file", str(path)], env={})
    with capture_logs() as logs:
        keys = load_admin_keys(config)
    assert keys.check("Bearer status-key") is None
    assert logs == []
    path.write_text("status-key scope=read\nops-key\n")  # no scope=: a write key
    with capture_logs() as logs:
        load_admin_keys(config)
    assert [(e["log_level"], e["key_ids"]) for e in logs] == [("warning", [key_id("ops-key")])]
    assert logs[0]["event"].startswith("the gateway holds admin keys of scope=write")
