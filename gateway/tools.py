"""Tool calling as domain objects: the functions offered, the choice, the calls made.

Both edges (OpenAI JSON in gateway/openai_tools.py, protobuf in gateway/server.py) build a
``ToolRequest``; the request path renders it into the prompt (gateway/tool_render.py) and,
for ``required`` or a named function, turns it into a grammar constraint built here, so any
model emits a call that parses and whose arguments match the function's JSON schema. What the
model wrote is split into content and calls by gateway/tool_parsers.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, NotRequired, Required, TypedDict

from canteen.json_defaults import engine_schema
from canteen.plan import Constraint, Sampling
from gateway.errors import InvalidInputError, clip

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required", "function")
ROLES = ("system", "user", "assistant", "tool")
# Compact JSON under the grammar: no whitespace loops for a model to get lost in, and the
# separators OpenAI's own outputs use.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# Calls one forced answer may hold with parallel_tool_calls: a model that prefers "another
# call" to "end of turn" (a small one often does) stops here rather than at max_tokens.
MAX_PARALLEL_CALLS = 4


@dataclass(frozen=True)
class Function:
    """A function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def openai_json(self) -> dict[str, Any]:
        """OpenAI's tool object, the shape chat templates that know tools expect."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; ``arguments`` is JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request and how the model may use them.

    ``choice`` is ``none`` (no tools offered, plain text), ``auto`` (the model decides; its
    own format is parsed), ``required`` (at least one call, enforced by a grammar) or
    ``function`` (a call of ``function_name``, enforced by a grammar).
    """

    functions: tuple[Function, ...]
    choice: str = "auto"
    function_name: str = ""
    parallel: bool = True

    @property
    def is_offered(self) -> bool:
        """Whether the model is told about the tools (not with ``none``)."""
        return self.choice != "none" and bool(self.functions)

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)


class ChatMessage(TypedDict, total=False):
    """One chat message; ``content`` is text ("" when a message carries only calls)."""

    role: Required[str]
    content: Required[str]
    tool_calls: NotRequired[list[ToolCall]]  # an assistant's calls, in the history
    tool_call_id: NotRequired[str]  # the call a role "tool" message answers
    name: NotRequired[str]  # the function a role "tool" message answers (optional)


def check_role(i: int, role: object) -> str:
    """``role`` when it is one a chat message may have; raises naming ``messages[i].role``."""
    if role not in ROLES:
        raise InvalidInputError(
            f"messages[{i}].role={clip(role)}: must be one of {', '.join(ROLES)}",
            param=f"messages[{i}].role",
        )
    return str(role)


def check_message(i: int, message: ChatMessage) -> ChatMessage:
    """``message`` when its fields fit its role: calls only on an assistant's, a call id
    (required) and a function name only on a tool's; raises naming the field."""
    role, where = check_role(i, message["role"]), f"messages[{i}]"
    only = {"tool_calls": "assistant", "tool_call_id": "tool", "name": "tool"}
    for key, owner in only.items():
        if key in message and role != owner:
            raise InvalidInputError(
                f"{where}.{key}: only on a {owner!r} message, not on a {role!r} one",
                param=f"{where}.{key}",
            )
    if role == "tool" and not message.get("tool_call_id"):
        raise InvalidInputError(
            f"{where}.tool_call_id: required on a tool message (the id of the call it answers)",
            param=f"{where}.tool_call_id",
        )
    return message


def check_tools(request: ToolRequest) -> ToolRequest:
    """``request`` when it is consistent; raises InvalidInputError naming the field."""
    if len(request.functions) > MAX_TOOLS:
        raise InvalidInputError(f"tools has {len(request.functions)} entries; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, function in enumerate(request.functions):
        if not _NAME.fullmatch(function.name):
            raise InvalidInputError(
                f"tools[{i}].function.name={function.name[:80]!r}: must be 1..64 letters, "
                "digits, underscores or dashes"
            )
        if function.name in seen:
            raise InvalidInputError(f"tools[{i}].function.name={function.name!r}: named twice")
        seen.add(function.name)
        if function.parameters.get("type", "object") != "object":
            raise InvalidInputError(
                f"tools[{i}].function.parameters.type={function.parameters['type']!r}: "
                "must be 'object' (arguments are a JSON object)"
            )
    if request.choice not in CHOICES:
        raise InvalidInputError(f"tool_choice={request.choice!r}: must be one of {CHOICES}")
    if request.is_forced and not request.functions:
        raise InvalidInputError(f"tool_choice={request.choice!r}: needs tools")
    if request.choice == "function" and request.function_name not in seen:
        known = ", ".join(sorted(seen)) or "none"
        raise InvalidInputError(
            f"tool_choice: function {request.function_name[:80]!r} is not in tools (given: {known})"
        )
    return request


def parameters_constraint(function: Function) -> Constraint:
    """The function's arguments schema alone, to check it compiles (and name it if not)."""
    return Constraint("json_schema", text=json.dumps(function.parameters, sort_keys=True))


def with_tool_constraint(sampling: Sampling, tools: ToolRequest | None) -> Sampling:
    """``sampling`` with the grammar that forces a call, for ``required`` or a function."""
    if tools is None or not tools.is_forced:
        return sampling
    if sampling.constraint is not None:
        raise InvalidInputError(
            f"tool_choice={tools.choice!r} already constrains the output; "
            "remove response_format or the guided_* field"
        )
    return replace(sampling, constraint=Constraint("grammar", text=call_grammar(tools)))


def call_grammar(tools: ToolRequest) -> str:
    """An llguidance (Lark) grammar: one ``<tool_call>`` block, or for ``required`` with
    parallel calls up to MAX_PARALLEL_CALLS of them, each holding ``{"name": ...,
    "arguments": ...}`` for an offered function, its arguments matching the schema. A named
    function is called exactly once. After a block closes the answer may end (end of
    sequence); once the list is full it must.

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>
    """
    functions = [
        f for f in tools.functions if tools.choice != "function" or f.name == tools.function_name
    ]
    many = tools.parallel and tools.choice == "required"
    lines = [
        f'start: tc ("\\n" tc){{0,{MAX_PARALLEL_CALLS - 1}}}' if many else "start: tc",
        f'tc: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"',
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
    ]
    lines += [f"call_{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    return "\n".join(lines) + "\n"


def _call_schema(function: Function) -> dict[str, Any]:
    """``{"name": const, "arguments": parameters}`` as one JSON document: the parameters'
    own ``$defs``/``definitions`` move to its root, where their ``#/...`` refs point."""
    arguments = dict(function.parameters)
    hoisted: dict[str, Any] = {
        key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments
    }
    arguments.setdefault("type", "object")
    closed: dict[str, Any] = engine_schema(
        {
            "x-guidance": _COMPACT,
            "type": "object",
            "properties": {"name": {"const": function.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            **hoisted,
        }
    )
    return closed
