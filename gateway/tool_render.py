"""Chat messages with tools, calls and results, as the input of a chat template.

A template that knows tools (its source mentions ``tools``, and gateway/tool_parsers.py
knows its family's call format) gets OpenAI-shaped structures: ``tools=`` and assistant
messages with ``tool_calls`` (arguments as objects, as Hugging Face templates expect) and
``role: "tool"`` messages. Any other template gets the fallback, in plain text it can render:

    system     (the caller's system text, then) "You can call these functions ..." with each
               function's {name, description, parameters} as compact JSON on its own line,
               and how to answer: one block per call,
               <tool_call>
               {"name": <function name>, "arguments": <object>}
               </tool_call>
    assistant  its text, then its calls written as those blocks
    tool       a user message, "<tool_response>\\n{content}\\n</tool_response>" per result
               (consecutive results share one message)
"""

from __future__ import annotations

import json
from typing import Any

from gateway.tools import CALL_CLOSE, CALL_OPEN, ChatMessage, ToolCall, ToolRequest

Conversation = list[dict[str, Any]]


def template_inputs(
    messages: list[ChatMessage], tools: ToolRequest | None, is_native: bool
) -> tuple[Conversation, dict[str, Any]]:
    """The conversation and the extra keyword arguments for ``apply_chat_template``."""
    offered = tools if tools is not None and tools.is_offered else None
    if is_native:
        extra = {"tools": [f.openai_json() for f in offered.functions]} if offered else {}
        return [_native(m) for m in messages], extra
    conversation = _fallback(messages)
    if offered is not None:
        conversation = _with_tool_prompt(conversation, offered)
    return conversation, {}


def _native(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content", "")}
    if "tool_calls" in message:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
            for call in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    return out


def call_block(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": json.loads(call.arguments)})
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _fallback(messages: list[ChatMessage]) -> Conversation:
    out: Conversation = []
    for message in messages:
        role, content = message["role"], message.get("content", "")
        if role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("is_tool_result"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "is_tool_result": True})
            continue
        calls = message.get("tool_calls") or []
        if calls:
            content = "\n".join(([content] if content else []) + [call_block(c) for c in calls])
        out.append({"role": role, "content": content})
    for entry in out:
        entry.pop("is_tool_result", None)
    return out


def tool_prompt(tools: ToolRequest) -> str:
    """The fallback's instructions: the tools as JSON, how to call, and what is required."""
    listed = "\n".join(_compact(f.openai_json()["function"]) for f in tools.functions)
    rule = {
        "auto": "Call a function when it helps; otherwise answer in plain text.",
        "required": "You must call at least one function.",
        "function": f"You must call the function {tools.function_name}.",
    }[tools.choice]
    many = "at most one call"
    if tools.parallel and tools.choice != "function":
        many = "one block per call"
    return (
        f"You can call these functions:\n{listed}\n\n"
        f"To call a function, answer with ({many}):\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n'
        f"{CALL_CLOSE}\n{rule}"
    )


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _with_tool_prompt(conversation: Conversation, tools: ToolRequest) -> Conversation:
    prompt = tool_prompt(tools)
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]
