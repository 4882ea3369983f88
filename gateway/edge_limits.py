"""The edge's limit table: every size a request is checked against before any work.

One frozen dataclass, shared by the HTTP and gRPC edges (the gRPC port's message limit is
``max_body_bytes`` too). ``GatewayConfig`` inherits it, so each limit is also a flag and a
CANTEEN_* variable; docs/security.md lists them. Refusals name the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from canteen.config import at_least, option, within
from gateway.tools import MAX_TOOLS


@dataclass(frozen=True)
class EdgeLimits:
    """Sizes checked before any tokenizing, template or grammar work, and the preparation
    pool that does that work off the event loop."""

    max_body_bytes: int = option(
        4 * 1024 * 1024,
        "largest HTTP request body and gRPC message, in bytes",
        at_least(1024),
    )
    max_prompt_chars: int = option(
        1_000_000, "longest prompt or message list, in characters", at_least(1)
    )
    max_messages: int = option(256, "most chat messages in one request", at_least(1))
    max_prompt_tokens: int = option(
        0, "most prompt tokens in one request (0: the model's context)", at_least(0)
    )
    max_output_tokens: int = option(
        0, "largest max_tokens a request may ask for (0: no limit)", at_least(0)
    )
    max_stop_strings: int = option(16, "most stop strings in one request", at_least(1))
    max_stop_length: int = option(256, "longest stop string, in characters", at_least(1))
    max_tools: int = option(
        MAX_TOOLS, f"most tools in one request (at most {MAX_TOOLS})", within(1, MAX_TOOLS)
    )
    max_tool_schema_bytes: int = option(
        16 * 1024, "largest JSON of one tool's parameters schema, in bytes", at_least(2)
    )
    max_schema_bytes: int = option(
        128 * 1024,
        "largest JSON of all schemas in one request (tools plus response_format), in bytes",
        at_least(2),
    )
    max_schema_depth: int = option(
        24, "deepest nesting of objects and arrays in one JSON schema", at_least(2)
    )
    prep_threads: int = option(
        2, "threads that tokenize, render templates and compile grammars", within(1, 64)
    )
    prep_queue: int = option(
        32, "requests that may wait for a preparation thread; past it: 429", at_least(0)
    )
    prep_deadline: float = option(
        10.0, "seconds one request's preparation may take; past it: 504", at_least(0.01)
    )
