"""The model's own tool-call formats, per family, and a splitter that streams content while
holding back what may be a call.

    format   families (config model_type)         what the model writes
    hermes   qwen2, qwen2_moe, qwen3, qwen3_moe,   <tool_call>{"name": ..., "arguments": ...}
             and every model on the fallback       </tool_call>, one block per call, after
             template (gateway/tool_render.py)     any text
    llama3   llama (a template that knows tools)   {"name": ..., "parameters": ...}, the whole
                                                   answer (calls joined by ";" allowed)
    mistral  mistral, mixtral                      [TOOL_CALLS] [{"name": ..., "arguments":
                                                   ...}, ...], the whole answer

A block that does not parse, or names a function that was not offered, stays in the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.tools import CALL_CLOSE, CALL_OPEN, ToolCall

Parse = Callable[[str, frozenset[str]], tuple[str, list[ToolCall]]]


@dataclass(frozen=True)
class CallFormat:
    """How one family writes calls. ``markers`` open a call; with ``at_start`` they count
    only at the start of the answer (after whitespace), else anywhere."""

    name: str
    markers: tuple[str, ...]
    at_start: bool
    parse: Parse  # (text from the first marker on, offered names) -> (content, calls)


def _call(obj: object, names: frozenset[str], keys: tuple[str, ...]) -> ToolCall | None:
    """A call from ``{"name": ..., <key>: {...}}``; arguments may also be JSON text."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(obj["name"]), json.dumps(arguments, ensure_ascii=False))


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)


def parse_hermes(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{json}</tool_call>`` blocks anywhere (the last may lack its close)."""
    calls: list[ToolCall] = []
    content, at = [], 0
    for match in _BLOCK.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), names, ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            continue
        calls.append(call)
        content.append(text[at : match.start()])
        at = match.end()
    content.append(text[at:])
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values separated by whitespace or ";"; None if anything else."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _whole_answer(prefix: str, keys: tuple[str, ...], is_list: bool) -> Parse:
    def parse(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(prefix)
        values = _json_values(body)
        if values and is_list:
            values = values[0] if len(values) == 1 and isinstance(values[0], list) else None
        calls = [_call(v, names, keys) for v in values or ()]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", [c for c in calls if c is not None]

    return parse


parse_llama3 = _whole_answer("<|python_tag|>", ("parameters", "arguments"), is_list=False)
parse_mistral = _whole_answer("[TOOL_CALLS]", ("arguments", "parameters"), is_list=True)

HERMES = CallFormat("hermes", (CALL_OPEN,), at_start=False, parse=parse_hermes)
# "{" and "[" too: a special token such as <|python_tag|> is dropped from the decoded text.
LLAMA3 = CallFormat("llama3", ("<|python_tag|>", "{"), at_start=True, parse=parse_llama3)
MISTRAL = CallFormat("mistral", ("[TOOL_CALLS]", "["), at_start=True, parse=parse_mistral)

# config.json model_type (or GGUF general.architecture) -> the format its template asks for
FAMILIES: dict[str, CallFormat] = {
    "qwen2": HERMES,
    "qwen2_moe": HERMES,
    "qwen3": HERMES,
    "qwen3_moe": HERMES,
    "llama": LLAMA3,
    "mistral": MISTRAL,
    "mixtral": MISTRAL,
}


def native_format(model_type: str, chat_template: str) -> CallFormat | None:
    """The format the model's own template teaches, when it knows tools and its family is
    known; None means the fallback template (which teaches hermes) renders the tools."""
    if "tools" not in chat_template:
        return None
    if CALL_OPEN in chat_template:  # e.g. Hermes fine-tunes of Llama: the template says so
        return HERMES
    return FAMILIES.get(model_type)


class ToolStream:
    """Splits one answer into content, released as it streams, and calls, parsed at the end.

    Text that may open a call (a marker, or the start of one at the end of the text so far)
    is held back; from the first marker on everything is buffered until ``finish``. With
    ``is_forced`` (a grammar wrote the answer: ``required`` or a named function) the whole
    answer is call markup, so none of it is content: a call cut short by ``max_tokens`` is
    dropped, and only the calls that closed are returned.
    """

    def __init__(self, fmt: CallFormat, names: frozenset[str], is_forced: bool = False) -> None:
        self._fmt, self._names, self._is_forced = fmt, names, is_forced
        self._pending = ""  # held: it may be the start of a marker
        self._calls: str | None = None  # the text from the first marker on
        self._is_content = False  # at_start formats: the answer did not open with a marker

    def push(self, text: str) -> str:
        """The part of ``text`` (with what was held) that is surely content."""
        if self._calls is not None:
            self._calls += text
            return ""
        self._pending += text
        if self._is_content:
            return self._release(len(self._pending))
        if self._fmt.at_start:
            return self._push_at_start()
        found = [i for i in (self._pending.find(m) for m in self._fmt.markers) if i >= 0]
        if found:
            at = min(found)
            self._calls = self._pending[at:]
            return self._release(at)
        return self._release(len(self._pending) - _held(self._pending, self._fmt.markers))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held, and the calls (empty when none parsed)."""
        if self._calls is None:
            held = self._release(len(self._pending))  # a forced answer cut inside its marker
            return ("" if self._is_forced else held), []
        text, self._calls = self._calls, None
        content, calls = self._fmt.parse(text, self._names)
        if self._is_forced:
            return "", calls
        return (content if calls else text), calls

    def _push_at_start(self) -> str:
        head = self._pending.lstrip()
        if not head:
            return ""
        if any(head.startswith(m) for m in self._fmt.markers):
            self._calls, self._pending = self._pending, ""
            return ""
        if any(m.startswith(head) for m in self._fmt.markers):
            return ""
        self._is_content = True
        return self._release(len(self._pending))

    def _release(self, upto: int) -> str:
        out, self._pending = self._pending[:upto], self._pending[upto:]
        return out


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that some marker starts with."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0
