"""OpenAI's tool-calling JSON: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the
messages' ``tool_calls`` / ``tool_call_id`` in; ``message.tool_calls`` and streamed
``tool_calls`` deltas out. The domain types are gateway/tools.py's.

Streaming follows OpenAI: per call, a delta with its ``index``, ``id``, ``type`` and the
function's ``name`` (arguments ""), then a delta with the ``arguments`` text; the choice's
last chunk has an empty delta and ``finish_reason`` "tool_calls".
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidInputError
from gateway.tools import ChatMessage, Function, ToolCall, ToolRequest, check_tools

TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools and choice; None when it offers none and forces nothing."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidInputError(
            f"parallel_tool_calls: expected a boolean, got {type(parallel).__name__}"
        )
    if raw is None and choice is None:
        return None
    if raw is not None and not isinstance(raw, list):
        raise InvalidInputError(f"tools: expected a list of tools, got {type(raw).__name__}")
    functions = tuple(_function(i, t) for i, t in enumerate(raw or []))
    mode, name = _choice(choice, bool(functions))
    request = ToolRequest(functions, mode, name, parallel is not False)
    return check_tools(request)


def _function(i: int, tool: object) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidInputError(f'{where}: expected {{"type": "function", "function": {{...}}}}')
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise InvalidInputError(f"{where}.function: expected an object with a name")
    name, description = spec.get("name"), spec.get("description") or ""
    if not isinstance(name, str):
        raise InvalidInputError(f"{where}.function.name: expected a string")
    if not isinstance(description, str):
        raise InvalidInputError(f"{where}.function.description: expected a string")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidInputError(f"{where}.function.parameters: expected a JSON schema object")
    return Function(name, description, parameters)


def _choice(choice: object, has_tools: bool) -> tuple[str, str]:
    """(mode, function name); unset is "auto" with tools and "none" without, as OpenAI."""
    if choice is None:
        return ("auto" if has_tools else "none"), ""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidInputError(
                f"tool_choice={choice[:40]!r}: must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
        return choice, ""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise InvalidInputError(
            'tool_choice: expected a string or {"type": "function", "function": {"name": ...}}'
        )
    return "function", name


def message_tool_fields(i: int, message: dict[str, Any], out: ChatMessage) -> None:
    """Copies an assistant's ``tool_calls`` and a tool message's ``tool_call_id`` (and
    ``name``) from ``message`` into ``out``, checking their shapes."""
    raw = message.get("tool_calls")
    if raw is not None:
        if message.get("role") != "assistant" or not isinstance(raw, list):
            raise InvalidInputError(
                f"messages[{i}].tool_calls: expected a list, on an assistant message"
            )
        out["tool_calls"] = [
            _history_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(raw)
        ]
    if message.get("role") == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidInputError(f"messages[{i}].tool_call_id: required on a tool message")
        out["tool_call_id"] = call_id
    name = message.get("name")
    if message.get("role") == "tool" and isinstance(name, str):
        out["name"] = name


def _history_call(where: str, call: object) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(function, dict):
        raise InvalidInputError(f'{where}: expected {{"id", "type": "function", "function"}}')
    name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"{where}.function.name: expected a string")
    if not isinstance(call_id, str):
        raise InvalidInputError(f"{where}.id: expected a string")
    if not isinstance(arguments, str):
        raise InvalidInputError(f"{where}.function.arguments: expected JSON text (a string)")
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        raise InvalidInputError(f"{where}.function.arguments: not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidInputError(f"{where}.function.arguments: expected a JSON object")
    return ToolCall(name, arguments, id=call_id)


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a whole answer."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def tool_call_chunks(chunk: dict[str, Any], calls: list[ToolCall]) -> list[dict[str, Any]]:
    """One streamed chat chunk that ends with ``calls`` as the chunks OpenAI sends: the
    chunk's own content (without its finish_reason), each call's name, then its arguments,
    and a last chunk with the finish_reason."""
    (choice,) = chunk["choices"]

    def with_delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        one = {**choice, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**chunk, "choices": [one]}

    head = {**chunk, "choices": [{**choice, "finish_reason": None}]}
    out = [head] if choice["delta"].get("content") or "role" in choice["delta"] else []
    for index, call in enumerate(calls):
        named = {"index": index, "id": call.id, "type": "function"}
        function = {"name": call.name, "arguments": ""}
        out.append(with_delta({"tool_calls": [{**named, "function": function}]}))
        arguments = {"index": index, "function": {"arguments": call.arguments}}
        out.append(with_delta({"tool_calls": [arguments]}))
    out.append(with_delta({}, choice["finish_reason"]))
    return out
