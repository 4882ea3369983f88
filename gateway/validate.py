"""What a request is, and the checks on its shape that need no tokenizer.

Every refusal is an InvalidInputError naming the field and the limit it broke.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from canteen.plan import MAX_STREAM_INTERVAL, Sampling
from gateway.edge_limits import EdgeLimits
from gateway.errors import InvalidInputError
from gateway.tools import ChatMessage, ToolRequest, check_role

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def choose_request_id(given: str) -> str:
    """The caller's x-request-id when it is a sane token, else a fresh one."""
    return given if _REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)  # seeded: the edge draws a seed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    disable_speculation: bool = False
    stream_interval: int = 0  # tokens per streamed message; 0: the gateway's default
    traceparent: str = ""  # the caller's W3C trace context, if it sent one
    arrival: float = field(default_factory=time.monotonic)
    # Functions the model may call (chat only); a forced choice's grammar is in sampling.
    tools: ToolRequest | None = None
    # Set by the HTTP edge's parser, which checks sampling before the fields that follow it;
    # the gateway checks each request's sampling once (the scheduler and worker again).
    is_sampling_checked: bool = False


def check_shape(inp: GenerateInput, c: EdgeLimits, is_schema_checked: bool = False) -> None:
    """Checks what needs no tokenizer; raises InvalidInputError naming field and limit.
    ``is_schema_checked``: the tools and constraint passed (another choice shares them)."""
    if (inp.prompt is None) == (inp.messages is None):
        raise InvalidInputError("exactly one of prompt or messages is required")
    if inp.prompt is not None:
        check_prompt(inp.prompt, c.max_prompt_chars)
    if inp.messages is not None:
        check_messages(inp.messages, c.max_messages, c.max_prompt_chars)
    if inp.tools is not None and inp.tools.functions and inp.messages is None:
        raise InvalidInputError("tools: need chat messages, not a prompt")
    if not is_schema_checked:
        check_schemas(inp, c)
    if inp.max_tokens is not None and inp.max_tokens < 1:
        raise InvalidInputError(f"max_tokens={inp.max_tokens}: must be >= 1")
    if c.max_output_tokens and inp.max_tokens is not None and inp.max_tokens > c.max_output_tokens:
        raise InvalidInputError(
            f"max_tokens={inp.max_tokens}: the limit is {c.max_output_tokens} (--max-output-tokens)"
        )
    if not 0 <= inp.stream_interval <= MAX_STREAM_INTERVAL:
        raise InvalidInputError(
            f"stream_interval={inp.stream_interval}: must be in 1..{MAX_STREAM_INTERVAL}"
            " (0 or unset: the gateway's default)",
            param="stream_interval",
        )
    if not inp.is_sampling_checked and (problem := inp.sampling.problem()) is not None:
        raise InvalidInputError(problem)
    if len(inp.stop) > c.max_stop_strings:
        raise InvalidInputError(
            f"stop has {len(inp.stop)} strings; the limit is {c.max_stop_strings}"
        )
    for text in inp.stop:
        if not text or len(text) > c.max_stop_length:
            raise InvalidInputError(
                f"stop strings must have 1..{c.max_stop_length} characters, got {len(text)}"
            )


def check_prompt(prompt: str, max_chars: int) -> None:
    if not prompt:
        raise InvalidInputError("prompt must not be empty")
    if len(prompt) > max_chars:
        raise InvalidInputError(f"prompt has {len(prompt)} characters; the limit is {max_chars}")


def check_messages(
    messages: Sequence[Mapping[str, object]], max_messages: int, max_chars: int
) -> None:
    if not messages:
        raise InvalidInputError("messages must not be empty")
    if len(messages) > max_messages:
        raise InvalidInputError(
            f"messages has {len(messages)} entries; the limit is {max_messages}"
        )
    total = 0
    for i, message in enumerate(messages):
        check_role(i, message.get("role"))
        total += len(str(message.get("content", "")))
    if total > max_chars:
        raise InvalidInputError(f"messages have {total} characters; the limit is {max_chars}")


def check_schemas(inp: GenerateInput, c: EdgeLimits) -> None:
    """Tools and the output constraint against the schema caps, before any compile: each
    tool's parameters, all schemas together, and how deep one nests."""
    functions = inp.tools.functions if inp.tools is not None else ()
    if len(functions) > c.max_tools:
        raise InvalidInputError(
            f"tools has {len(functions)} entries; the limit is {c.max_tools} (--max-tools)",
            param="tools",
        )
    total = 0
    for i, function in enumerate(functions):
        where = f"tools[{i}].function.parameters"
        size = len(json.dumps(function.parameters).encode())
        if size > c.max_tool_schema_bytes:
            raise InvalidInputError(
                f"{where}: {size} bytes of JSON; the limit is {c.max_tool_schema_bytes} "
                "(--max-tool-schema-bytes)",
                param=where,
            )
        _check_depth(function.parameters, where, c.max_schema_depth)
        total += size
    constraint = inp.sampling.constraint
    is_tool_grammar = inp.tools is not None and inp.tools.is_forced  # made of the tools above
    if constraint is not None and not is_tool_grammar:
        total += len(constraint.text.encode())
        if constraint.kind == "json_schema" and constraint.text:
            _check_depth(json.loads(constraint.text), "response_format", c.max_schema_depth)
    if total > c.max_schema_bytes:
        raise InvalidInputError(
            f"the request's schemas have {total} bytes of JSON; the limit is "
            f"{c.max_schema_bytes} (--max-schema-bytes)"
        )


def _check_depth(value: object, where: str, limit: int) -> None:
    """Refuses a JSON value whose objects and arrays nest deeper than ``limit``."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise InvalidInputError(
                f"{where}: nests {depth} levels deep; the limit is {limit} (--max-schema-depth)",
                param=where,
            )
        stack.extend((child, depth + 1) for child in children)
