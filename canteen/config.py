"""Typed service configuration read from flags and CANTEEN_* environment variables.

Each service declares a frozen dataclass whose fields carry a one-line ``help`` in their
metadata; ``parse_config`` turns it into argparse flags (``--max-queue``) whose defaults come
from the environment (``CANTEEN_MAX_QUEUE``) and then from the dataclass. A field declares its
bound with it (``option(1, "...", at_least(1))``); ``check_bounds``, called from the dataclass's
``__post_init__``, raises a ``ValueError`` naming the field, its value and the rule. Rules over
several fields follow it there, with ``require``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class Bound:
    """What one field's value must satisfy, and the rule an error states when it does not."""

    holds: Callable[[Any], bool]
    rule: str


def at_least(low: float) -> Bound:
    return Bound(lambda value: value >= low, f"must be >= {low}")


def within(low: float, high: float, rule: str = "") -> Bound:
    """``low <= value <= high``; the rule reads ``must be in low..high`` unless given."""
    return Bound(lambda value: low <= value <= high, rule or f"must be in {low}..{high}")


def one_of(*values: object, rule: str = "") -> Bound:
    """One of ``values``; the rule lists them (``must be a, b or c``) unless given."""
    words = ", ".join(str(value) for value in values[:-1]) + f" or {values[-1]}"
    return Bound(lambda value: value in values, rule or f"must be {words}")


PORT = within(0, 65535)
PORT_OR_OFF = within(-1, 65535, "must be in 0..65535, or -1 for off")


def option(default: Any, help: str, bound: Bound | None = None) -> Any:
    """A dataclass field with a default, a one-line help text and the bound its value keeps."""
    return dataclasses.field(default=default, metadata={"help": help, "bound": bound})


def check_bounds(config: Any) -> None:
    """Raises a ValueError for the first field, in declaration order, outside its bound."""
    for field in dataclasses.fields(config):
        bound = field.metadata.get("bound")
        value = getattr(config, field.name)
        if bound is not None:
            require(bound.holds(value), field.name, value, bound.rule)


def parse_bytes(text: str) -> int:
    """Parses a byte size such as ``512MiB``, ``2GiB`` or ``1000000``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 512MiB or 2GiB)")
    size = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if size.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(size)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def require(condition: bool, field: str, value: object, rule: str) -> None:
    """Raises a ValueError naming the field, its value and the rule it broke."""
    if not condition:
        raise ValueError(f"{field}={value!r}: {rule}")


def _base_type(hint: Any) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def _env_name(field_name: str) -> str:
    return "CANTEEN_" + field_name.upper()


def _convert(kind: Any, raw: str) -> Any:
    if kind is bool:
        return parse_bool(raw)
    if kind is int:
        return int(raw)
    if kind is float:
        return float(raw)
    return raw


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{field.metadata.get('help', '')} (env {_env_name(field.name)})"
        if kind is bool:
            parser.add_argument(
                flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(flag, dest=field.name, default=None, help=help_text)
    return parser


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str = "canteen",
    description: str = "",
) -> T:
    """Builds ``cls`` from flags, then CANTEEN_* variables, then the dataclass defaults."""
    env = os.environ if env is None else env
    parser = build_parser(cls, prog, description)
    args = parser.parse_args(argv)
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = _base_type(hints[field.name])
        raw = getattr(args, field.name)
        try:
            if raw is not None:
                values[field.name] = raw if kind is bool else _convert(kind, raw)
            elif _env_name(field.name) in env:
                values[field.name] = _convert(kind, env[_env_name(field.name)])
        except ValueError as exc:
            parser.error(f"{field.name}: {exc}")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits
