"""Content screens: reject prompts and cut streamed output that match a policy.

A screen is any object with two methods (the ``Screen`` protocol)::

    screen_input(text) -> str | None          None: ok; else why the prompt is rejected
    screen_output(text_so_far) -> str | None  None: ok; else why the stream is cut

``screen_output`` always sees the whole text streamed so far, not the latest chunk, so a
phrase split across chunks is still caught; ``StreamScreen`` keeps that text for one stream
(and tells a screen that can use it how much already passed, to keep streams linear).
Screens are loaded from an entry point ``package.module:factory`` (``load_screen``); the
built-in ``DenyListScreen`` rejects text matching case-insensitive regexes, by default a list
of common prompt-injection phrases (``gateway.screen:deny_list``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

# Common prompt-injection phrases, matched case-insensitively anywhere in the text.
DEFAULT_PATTERNS: tuple[str, ...] = (
    r"\bignore\s+(?:all\s+|any\s+)?(?:(?:the|your|my)\s+)?(?:previous|prior|above|earlier|"
    r"preceding)\s+(?:instructions|prompts?|directions|rules)\b",
    r"\bdisregard\s+(?:all\s+)?(?:(?:the|your)\s+)?(?:previous|prior|above|earlier)\s+"
    r"(?:instructions|prompts?|directions|rules)\b",
    r"\bdisregard\s+(?:(?:the|your)\s+)?system\s+prompt\b",
    r"\bforget\s+(?:all\s+)?(?:(?:the|your)\s+)?(?:previous|prior|above|earlier)\s+"
    r"(?:instructions|prompts?|rules)\b",
    r"\byou\s+are\s+now\s+DAN\b",
    r"\b(?:DAN|developer|jailbreak)\s+mode\s+(?:enabled|activated|on)\b",
    r"\breveal\s+(?:(?:your|the)\s+)?(?:system\s+prompt|hidden\s+instructions|"
    r"initial\s+instructions)\b",
    r"\b(?:print|show|repeat|output|display)\s+(?:me\s+)?(?:(?:your|the)\s+)?"
    r"(?:system\s+prompt|initial\s+instructions)\b",
    r"\bpretend\s+(?:that\s+)?(?:you\s+have|there\s+are)\s+no\s+"
    r"(?:rules|restrictions|guidelines|filters)\b",
    r"\bact\s+as\s+(?:an?\s+)?(?:unrestricted|unfiltered|uncensored)\s+"
    r"(?:ai|assistant|model|chatbot)\b",
    r"\boverride\s+(?:(?:your|the)\s+)?(?:safety|content)\s+(?:filters?|policies|guidelines|rules)\b",
)

_SNIPPET = 80  # longest matched text quoted back in a rejection


class ScreenError(ValueError):
    """A screen or its configuration cannot be loaded; the message names the source."""


@runtime_checkable
class Screen(Protocol):
    """Decides whether a prompt may run and whether streamed output may continue."""

    def screen_input(self, text: str) -> str | None:
        """None when ``text`` may be sent to the model, else the reason it is rejected."""
        ...

    def screen_output(self, text_so_far: str) -> str | None:
        """None when the output so far may be streamed, else the reason to cut it."""
        ...


class DenyListScreen:
    """Rejects prompts and cuts output that match any of its case-insensitive regexes.

    Streamed output is screened incrementally: with ``num_screened`` (the length of the
    prefix that already passed) only the new text and the ``max_match_chars`` before it are
    searched, so screening a stream costs time linear in its length. A match that reaches
    back further than that across pushes is missed; whole texts are always searched fully.
    """

    def __init__(self, patterns: Sequence[str], max_match_chars: int = 256) -> None:
        if max_match_chars < 1:
            raise ScreenError(f"max_match_chars={max_match_chars}: must be >= 1")
        self.patterns = tuple(patterns)
        self.max_match_chars = max_match_chars
        compiled = [_compile(p, f"deny-list pattern {i}") for i, p in enumerate(patterns, 1)]
        self._regexes = _combine(compiled)

    @classmethod
    def with_defaults(cls, patterns_file: str | None = None) -> DenyListScreen:
        """DEFAULT_PATTERNS plus the patterns of ``patterns_file`` when given."""
        extra = load_patterns(patterns_file) if patterns_file else []
        return cls([*DEFAULT_PATTERNS, *extra])

    def screen_input(self, text: str) -> str | None:
        match = self._search(text, 0)
        if match is None:
            return None
        snippet = match.group(0)[:_SNIPPET]
        return f"prompt rejected by the content screen: {snippet!r} is a deny-listed phrase"

    def screen_output(self, text_so_far: str, num_screened: int = 0) -> str | None:
        # Never quote the output back: what it matched may be what the screen protects.
        start = max(0, num_screened - self.max_match_chars)
        if self._search(text_so_far, start) is None:
            return None
        return "output stopped by the content screen (deny-listed phrase)"

    def _search(self, text: str, start: int) -> re.Match[str] | None:
        # search(text, pos), not text[pos:]: \b and lookbehinds still see the text before pos
        for regex in self._regexes:
            match = regex.search(text, start)
            if match is not None:
                return match
        return None


def _combine(compiled: list[re.Pattern[str]]) -> list[re.Pattern[str]]:
    """One alternation for the patterns without groups (3-4x faster), the rest alone.

    Patterns with groups stay separate so their backreferences keep their numbers.
    """
    plain = [r.pattern for r in compiled if r.groups == 0]
    rest = [r for r in compiled if r.groups > 0]
    if len(plain) < 2:
        return compiled
    try:
        combined = re.compile("|".join(f"(?:{p})" for p in plain), re.IGNORECASE)
    except re.error:  # e.g. a global inline flag such as (?s) inside one pattern
        return compiled
    return [combined, *rest]


def load_patterns(path: str) -> list[str]:
    """One regex a line; blank lines and lines starting with ``#`` are skipped.

    Raises ScreenError naming the file and line of a missing file or a bad regex.
    """
    file = Path(path)
    if not file.is_file():
        raise ScreenError(f"deny-list file {path!r}: no such file")
    patterns = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        _compile(pattern, f"deny-list file {path!r} line {number}")
        patterns.append(pattern)
    return patterns


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise ScreenError(f"{where}: invalid regex {pattern!r}: {exc}") from None


def deny_list(config: Mapping[str, Any] | None = None) -> DenyListScreen:
    """Factory for ``load_screen("gateway.screen:deny_list", config)``.

    Config keys: ``defaults`` (bool, default true: include DEFAULT_PATTERNS),
    ``patterns_file`` (path, one regex a line) and ``patterns`` (list of regexes).
    """
    config = dict(config or {})
    unknown = sorted(set(config) - {"defaults", "patterns_file", "patterns"})
    if unknown:
        raise ScreenError(
            f"deny_list: unknown config key(s) {', '.join(unknown)}; "
            "use defaults, patterns_file, patterns"
        )
    defaults = config.get("defaults", True)
    extra = config.get("patterns", [])
    if not isinstance(defaults, bool):
        raise ScreenError(f"deny_list: defaults={defaults!r}: must be true or false")
    if not isinstance(extra, list) or not all(isinstance(p, str) for p in extra):
        raise ScreenError(f"deny_list: patterns={extra!r}: must be a list of strings")
    patterns = [*(DEFAULT_PATTERNS if defaults else ()), *extra]
    if config.get("patterns_file"):
        patterns += load_patterns(str(config["patterns_file"]))
    return DenyListScreen(patterns)


def load_screen(spec: str, config: Mapping[str, Any] | None = None) -> Screen:
    """Builds the screen named by the entry point ``spec`` (``package.module:factory``).

    The factory (a function or a class) is called with no arguments, or with ``config`` as
    a dict when given. Raises ScreenError naming ``spec`` when the module cannot be
    imported, the factory is missing or fails, or what it returns lacks the two methods.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ScreenError(
            f"content screen {spec!r}: must be an entry point 'package.module:factory'"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ScreenError(
            f"content screen {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ScreenError(f"content screen {spec!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ScreenError(f"content screen {spec!r}: {attr!r} is not callable")
    screen = _call_factory(spec, target, config)
    missing = [
        m for m in ("screen_input", "screen_output") if not callable(getattr(screen, m, None))
    ]
    if missing:
        raise ScreenError(
            f"content screen {spec!r}: the factory returned a {type(screen).__name__}, "
            f"which has no {' or '.join(missing)} method"
        )
    return cast(Screen, screen)


def _call_factory(spec: str, factory: Callable[..., Any], config: Mapping[str, Any] | None) -> Any:
    try:
        return factory() if config is None else factory(dict(config))
    except ScreenError as exc:
        raise ScreenError(f"content screen {spec!r}: {exc}") from exc
    except Exception as exc:
        raise ScreenError(
            f"content screen {spec!r}: the factory raised {type(exc).__name__}: {exc}"
        ) from exc


def screen_prompt(
    screen: Screen,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, object]] | None = None,
) -> str | None:
    """Screens a prompt, or each chat message's content; the reason names the message."""
    if prompt is not None:
        return screen.screen_input(prompt)
    for i, message in enumerate(messages or ()):
        reason = screen.screen_input(str(message.get("content", "")))
        if reason is not None:
            return f"messages[{i}]: {reason}"
    return None


class StreamScreen:
    """Screens one streamed response: keeps the text so far and asks about all of it.

    Create one per stream; call ``push`` with each new piece of text before sending it.
    When it returns a reason, do not send that piece: end the stream (finish reason
    ``content_filter``) and cancel the request upstream. A screen whose ``screen_output``
    takes a ``num_screened`` keyword (as DenyListScreen's does) is told how much of the
    text already passed, so it can search only the new part.
    """

    def __init__(self, screen: Screen) -> None:
        self._screen = screen
        self._is_incremental = _takes_num_screened(screen)
        self.text = ""
        """All the text pushed so far."""
        self.reason: str | None = None
        """Why the stream was cut; None while it may continue."""

    @property
    def is_cut(self) -> bool:
        return self.reason is not None

    def push(self, delta: str) -> str | None:
        """None when the output including ``delta`` may continue, else the reason to cut."""
        if self.reason is not None or not delta:
            return self.reason
        num_screened = len(self.text)
        self.text += delta
        if self._is_incremental:
            screen_output = cast(_IncrementalOutput, self._screen.screen_output)
            self.reason = screen_output(self.text, num_screened=num_screened)
        else:
            self.reason = self._screen.screen_output(self.text)
        return self.reason


class _IncrementalOutput(Protocol):
    def __call__(self, text_so_far: str, *, num_screened: int) -> str | None: ...


_INCREMENTAL: dict[type, bool] = {}


def _takes_num_screened(screen: Screen) -> bool:
    kind = type(screen)
    if kind not in _INCREMENTAL:
        try:
            param = inspect.signature(screen.screen_output).parameters.get("num_screened")
        except (TypeError, ValueError):  # builtins without a signature
            param = None
        _INCREMENTAL[kind] = param is not None and param.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
    return _INCREMENTAL[kind]
