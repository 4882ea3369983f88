"""Several gateway processes on the same public ports (``canteen up --gateways N``).

Each process counts rate limits on its own: a key's requests spread over N processes could
get N times the configured limit. So ``canteen up`` gives each process the configured limit
divided by N (rounded down, at least 1): the suite as a whole never lets a key past the
limit (unless the limit is below N), though a key whose connections all land on one process
gets less than the limit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RATE_LIMIT_FLAGS = ("--rate-limit-rpm", "--rate-limit-tpm")


def configured_limit(args: list[str], flag: str, env: Mapping[str, str]) -> int:
    """The value the gateway would take for ``flag``: its last occurrence in ``args``
    (``--flag=V`` or ``--flag V``), else its CANTEEN_* variable, else 0 (unlimited)."""
    value = env.get("CANTEEN_" + flag.removeprefix("--").replace("-", "_").upper(), "0")
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag.removeprefix('--')}={value!r}: must be an integer") from None


def share_rate_limits(
    args: list[str], num_gateways: int, env: Mapping[str, str] | None = None
) -> list[str]:
    """``args`` with each configured per-key limit divided among ``num_gateways``
    processes (appended last, so it wins)."""
    env = os.environ if env is None else env
    shared = list(args)
    for flag in RATE_LIMIT_FLAGS:
        limit = configured_limit(args, flag, env)
        if limit > 0:
            shared.append(f"{flag}={max(1, limit // num_gateways)}")
    return shared
