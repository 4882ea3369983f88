"""Admin keys and their two scopes: ``read`` and ``write``.

``read`` opens the gateway's ``/status`` and public ``/metrics``; ``write`` also opens the
registry's writes (AddModel, DeleteModel, SetAlias, DeleteAlias: models add/delete/alias and
canary weights). An admin keys file holds one key a line, optionally with its scope::

    canteen-admin-...   scope=write    the operators' key: registry writes
    canteen-status-...  scope=read     the gateway's key: /status and /metrics only

A line without ``scope=`` is a write key (the format before scopes). The gateway is internet
facing, so it is given only read keys and warns about any other. Keys are kept as sha256
digests (canteen/auth.py) and named by their key id.
"""

from __future__ import annotations

from dataclasses import dataclass

from canteen.auth import ApiKeys, AuthenticationError, KeySpec, Principal, read_key_lines

READ, WRITE = "read", "write"
SCOPES = (READ, WRITE)


class ScopeError(PermissionError):
    """A valid admin key whose scope does not cover the call (gRPC PERMISSION_DENIED)."""

    def __init__(self, key_id: str, scope: str, action: str, needed: str) -> None:
        super().__init__(
            f"admin key {key_id} has scope={scope}: {action} needs an admin key with scope={needed}"
        )


def parse_admin_line(line: str) -> tuple[str, str]:
    """``KEY [scope=read|write]`` to (key, scope); ValueError never quotes the key."""
    key, *options = line.split()
    scope = WRITE
    for option in options:
        name, sep, value = option.partition("=")
        if name != "scope" or not sep:
            raise ValueError("the only option of an admin key is scope=read or scope=write")
        if value not in SCOPES:
            raise ValueError(f"scope={value!r}: must be read or write")
        scope = value
    return key, scope


@dataclass(frozen=True)
class AdminKeys:
    """The configured admin keys (digests) and each one's scope, by key id."""

    keys: ApiKeys
    scopes: dict[str, str]

    @classmethod
    def load(cls, keys_file: str, keys_env: str) -> AdminKeys:
        """Write keys from the comma-separated ``keys_env``; scoped keys from ``keys_file``."""
        pairs = [(k.strip(), WRITE) for k in keys_env.split(",") if k.strip()]
        if keys_file:
            pairs += read_key_lines(keys_file, "admin_keys_file", parse_admin_line)
        scopes: dict[str, str] = {}
        for key, scope in pairs:
            known = scopes.setdefault(ApiKeys([key]).principals[0].key_id, scope)
            if known != scope:
                raise ValueError("admin keys: one key is listed with both scope=read and write")
        try:
            return cls(ApiKeys([KeySpec(key) for key, _ in pairs]), scopes)
        except ValueError as exc:
            raise ValueError(f"admin keys: {exc}") from None

    @classmethod
    def all_write(cls, keys: ApiKeys) -> AdminKeys:
        """Every key of ``keys`` with scope write."""
        return cls(keys, {p.key_id: WRITE for p in keys.principals})

    @property
    def is_enabled(self) -> bool:
        return self.keys.is_enabled

    def key_ids(self, scope: str) -> list[str]:
        """The ids of the keys that have ``scope``, in the order configured."""
        return [p.key_id for p in self.keys.principals if self.scopes[p.key_id] == scope]

    def authorize(self, authorization: str | None, action: str, needed: str) -> Principal:
        """The caller, when its key covers ``needed``; raises AuthenticationError or
        ScopeError (which names the key id, its scope, the action and the scope it needs)."""
        principal = self.keys.authenticate(authorization)
        scope = self.scopes.get(principal.key_id, "")
        if needed == WRITE and scope != WRITE:
            raise ScopeError(principal.key_id, scope, action, needed)
        return principal


__all__ = ["READ", "WRITE", "AdminKeys", "AuthenticationError", "ScopeError"]
