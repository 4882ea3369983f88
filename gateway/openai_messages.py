"""OpenAI chat messages in, as ``ChatMessage`` domain objects; every key is honoured or refused.

What each role may carry, and where the chat template (gateway/tool_render.py) uses it:

    system, user  role, content
    assistant     role, content, tool_calls (rendered as the model's calls)
    tool          role, content, tool_call_id (required), name (given to templates that
                  know tools; the fallback template renders results by position)

``content`` is a string or a list of text parts ``{"type": "text", "text": ...}``. A null
leaves an OpenAI message key unset, so the keys OpenAI's answers carry and the ``openai``
client writes back with ``model_dump()`` (``refusal``, ``annotations``, ``audio``,
``function_call``) pass when null; any other key, or one on a role that does not take it, is
refused with 400 naming its path, e.g. ``messages[1].foo``.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidInputError, refuse_unknown
from gateway.tools import ChatMessage, ToolCall, check_message, check_role

_KEYS = {
    "system": frozenset({"role", "content"}),
    "user": frozenset({"role", "content"}),
    "assistant": frozenset({"role", "content", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}
# OpenAI's message keys that a null leaves unset; the last four only pass as null.
_UNSET_WHEN_NULL = frozenset(
    {"name", "tool_calls", "tool_call_id", "refusal", "annotations", "audio", "function_call"}
)
_PART_KEYS = frozenset({"type", "text"})
_CALL_KEYS = frozenset({"id", "type", "function"})
_CALL_FUNCTION_KEYS = frozenset({"name", "arguments"})


def check_text(text: str, name: str) -> str:
    """``text`` when it is valid Unicode; JSON escapes can smuggle in lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{name}: not valid Unicode (a lone surrogate at character {exc.start})",
            param=name,
        ) from None
    return text


def parse_messages(raw: object) -> list[ChatMessage]:
    """Chat messages as {role, content} strings, with an assistant's tool_calls and a tool
    message's tool_call_id and name; content parts are joined text parts."""
    if not isinstance(raw, list):
        raise InvalidInputError(
            "messages: expected a list of {role, content} objects", param="messages"
        )
    return [_message(i, m) for i, m in enumerate(raw)]


def _message(i: int, m: object) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidInputError(f"{where}: expected an object with role and content", param=where)
    role = m.get("role")
    if not isinstance(role, str):
        raise InvalidInputError(
            f"{where}.role: expected a string, got {type(role).__name__}", param=f"{where}.role"
        )
    check_role(i, role)
    present = {k: v for k, v in m.items() if not (k in _UNSET_WHEN_NULL and v is None)}
    refuse_unknown(where, present, _KEYS[role], on=f" on a {role!r} message")
    message: ChatMessage = {"role": role, "content": _content(where, m.get("content"))}
    if m.get("tool_calls") is not None:
        message["tool_calls"] = _history_calls(where, m["tool_calls"])
    if (call_id := _string(where, m, "tool_call_id")) is not None:
        message["tool_call_id"] = call_id
    if (name := _string(where, m, "name")) is not None:
        message["name"] = name
    return check_message(i, message)


def _string(where: str, m: dict[str, Any], key: str) -> str | None:
    value = m.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(
            f"{where}.{key}: expected a string, got {type(value).__name__}", param=f"{where}.{key}"
        )
    return value


def _content(where: str, content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: only text parts carry meaning here
        texts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidInputError(f"{at}: only text parts are supported", param=at)
            refuse_unknown(at, part, _PART_KEYS)
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidInputError(
                    f"{at}.text: expected a string, got {type(text).__name__}", param=f"{at}.text"
                )
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidInputError(
            f"{where}.content: expected a string or text parts", param=f"{where}.content"
        )
    return check_text(content, f"{where}.content")


def _history_calls(where: str, raw: object) -> list[ToolCall]:
    if not isinstance(raw, list):
        raise InvalidInputError(
            f"{where}.tool_calls: expected a list, on an assistant message",
            param=f"{where}.tool_calls",
        )
    return [_history_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(raw)]


def _history_call(where: str, call: object) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(function, dict):
        raise InvalidInputError(
            f'{where}: expected {{"id", "type": "function", "function"}}', param=where
        )
    refuse_unknown(where, call, _CALL_KEYS)
    refuse_unknown(f"{where}.function", function, _CALL_FUNCTION_KEYS)
    if call.get("type", "function") != "function":
        raise InvalidInputError(f"{where}.type: must be 'function'", param=f"{where}.type")
    name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
    if not isinstance(name, str) or not name:
        raise InvalidInputError(
            f"{where}.function.name: expected a string", param=f"{where}.function.name"
        )
    if not isinstance(call_id, str):
        raise InvalidInputError(f"{where}.id: expected a string", param=f"{where}.id")
    at = f"{where}.function.arguments"
    if not isinstance(arguments, str):
        raise InvalidInputError(f"{at}: expected JSON text (a string)", param=at)
    try:
        parsed: Any = json.loads(arguments)
    except ValueError as exc:
        raise InvalidInputError(f"{at}: not valid JSON: {exc}", param=at) from None
    if not isinstance(parsed, dict):
        raise InvalidInputError(f"{at}: expected a JSON object", param=at)
    return ToolCall(name, arguments, id=call_id)
