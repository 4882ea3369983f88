"""OpenAI's tool-calling JSON: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` in
(the messages' ``tool_calls`` / ``tool_call_id`` are gateway/openai_messages.py's);
``message.tool_calls`` and streamed ``tool_calls`` deltas out. The domain types are
gateway/tools.py's.

A tool is ``{"type": "function", "function": {name, description, parameters, strict}}``;
any other key is refused naming its path. ``strict: true`` is honoured where the arguments
are enforced (``required``, a named function; ``none`` makes no call) and refused with
``auto``, where the model's own calls are parsed but not constrained.

Streaming follows OpenAI: per call, a delta with its ``index``, ``id``, ``type`` and the
function's ``name`` (arguments ""), then a delta with the ``arguments`` text; the choice's
last chunk has an empty delta and ``finish_reason`` "tool_calls".
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidInputError, refuse_unknown
from gateway.tools import Function, ToolCall, ToolRequest, check_tools

TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools and choice; None when it offers none and forces nothing."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidInputError(
            f"parallel_tool_calls: expected a boolean, got {type(parallel).__name__}",
            param="parallel_tool_calls",
        )
    if raw is not None and not isinstance(raw, list):
        raise InvalidInputError(
            f"tools: expected a list of tools, got {type(raw).__name__}", param="tools"
        )
    if parallel is not None and not raw:  # as OpenAI: it would say nothing without tools
        raise InvalidInputError(
            "parallel_tool_calls: only allowed when tools are given", param="parallel_tool_calls"
        )
    if raw is None and choice is None:
        return None
    parsed = [_function(i, t) for i, t in enumerate(raw or [])]
    functions = tuple(function for function, _ in parsed)
    mode, name = _choice(choice, bool(functions))
    for i, (_, is_strict) in enumerate(parsed):
        if is_strict and mode == "auto":
            raise InvalidInputError(
                f"tools[{i}].function.strict=true: not supported with tool_choice 'auto' (the "
                "model's own calls are parsed, not enforced); arguments are enforced with "
                "'required' or a named function, or remove strict",
                param=f"tools[{i}].function.strict",
            )
    request = ToolRequest(functions, mode, name, parallel is not False)
    return check_tools(request)


def _function(i: int, tool: object) -> tuple[Function, bool]:
    """A tool's function and whether it asks for ``strict`` arguments."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidInputError(
            f'{where}: expected {{"type": "function", "function": {{...}}}}', param=where
        )
    refuse_unknown(where, tool, _TOOL_KEYS)
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise InvalidInputError(
            f"{where}.function: expected an object with a name", param=f"{where}.function"
        )
    where += ".function"
    refuse_unknown(where, spec, _FUNCTION_KEYS)
    name, description = spec.get("name"), spec.get("description")
    strict, parameters = spec.get("strict"), spec.get("parameters")
    description = "" if description is None else description
    if not isinstance(name, str) or not isinstance(description, str):
        key = "description" if isinstance(name, str) else "name"
        raise InvalidInputError(f"{where}.{key}: expected a string", param=f"{where}.{key}")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidInputError(f"{where}.strict: expected a boolean", param=f"{where}.strict")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidInputError(
            f"{where}.parameters: expected a JSON schema object", param=f"{where}.parameters"
        )
    return Function(name, description, parameters), bool(strict)


def _choice(choice: object, has_tools: bool) -> tuple[str, str]:
    """(mode, function name); unset is "auto" with tools and "none" without, as OpenAI."""
    if choice is None:
        return ("auto" if has_tools else "none"), ""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidInputError(
                f"tool_choice={choice[:40]!r}: must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        return choice, ""
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise InvalidInputError(
            'tool_choice: expected a string or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    refuse_unknown("tool_choice", choice, _TOOL_KEYS)
    refuse_unknown("tool_choice.function", function, frozenset({"name"}))
    return "function", str(function["name"])


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
