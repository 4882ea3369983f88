"""OpenAI wire shapes: JSON bodies in, GenerateInput out; TextDeltas in, JSON chunks out.

Only translation lives here; the request path is gateway/service.py. Unknown body fields
are ignored, as OpenAI's own clients send fields a server may not know; a known field of the
wrong type or range is refused with a message naming it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from canteen.codec import random_seed
from canteen.plan import MAX_TOP_LOGPROBS, Sampling
from gateway.errors import InvalidInputError
from gateway.openai_tools import (
    TOOL_FIELDS,
    message_tool_fields,
    parse_tools,
    tool_call_chunks,
    tool_calls_json,
)
from gateway.service import GenerateInput, TextDelta
from gateway.structured import CONSTRAINT_FIELDS, constraint_from_body
from gateway.tools import ChatMessage, ToolCall, ToolRequest, with_tool_constraint

MAX_N = 4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # int64 or uint64; sent upstream modulo 2**64


@dataclass(frozen=True)
class OpenAIRequest:
    """One chat or completions request, parsed."""

    kind: str  # "chat" or "completion"
    inputs: list[GenerateInput]  # one per choice (n)
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    model: str
    user: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return f"{prefix}-{self.inputs[0].request_id}"


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise InvalidInputError(f"{name}: expected {_kind_name(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise InvalidInputError(f"{name}: expected {_kind_name(kinds)}, got {type(value).__name__}")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = _get(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range (JSON allows any digits)
        raise InvalidInputError(f"{name}: the number is too large") from None


def check_text(text: str, name: str) -> str:
    """``text`` when it is valid Unicode; JSON escapes can smuggle in lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{name}: not valid Unicode (a lone surrogate at character {exc.start})"
        ) from None
    return text


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    ks = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in ks)


def _messages(body: dict[str, Any]) -> list[ChatMessage]:
    return parse_messages(body.get("messages"))


def parse_messages(raw: object) -> list[ChatMessage]:
    """Chat messages as {role, content} strings, with an assistant's tool_calls and a tool
    message's tool_call_id; content parts are joined text parts."""
    if not isinstance(raw, list):
        raise InvalidInputError("messages: expected a list of {role, content} objects")
    out: list[ChatMessage] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidInputError(f"messages[{i}]: expected an object with role and content")
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidInputError(
                f"messages[{i}].role: expected a string, got {type(role).__name__}"
            )
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: only text parts carry meaning here
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidInputError(
                        f"messages[{i}].content[{j}]: only text parts are supported"
                    )
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise InvalidInputError(
                        f"messages[{i}].content[{j}].text: expected a string, "
                        f"got {type(text).__name__}"
                    )
                parts.append(text)
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidInputError(f"messages[{i}].content: expected a string or text parts")
        message: ChatMessage = {
            "role": role,
            "content": check_text(content, f"messages[{i}].content"),
        }
        message_tool_fields(i, m, message)
        out.append(message)
    return out


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidInputError("prompt: expected a string (or a list of exactly one string)")
    return check_text(prompt, "prompt")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [check_text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [check_text(s, f"stop[{i}]") for i, s in enumerate(stop)]
    raise InvalidInputError("stop: expected a string or a list of strings")


# Fields each endpoint honours; anything else is refused by name, never silently dropped.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "seed", "logprobs", "user", "ignore_eos", "priority", "disable_speculation",
}  # fmt: skip
_FIELDS = {
    "chat": _COMMON
    | CONSTRAINT_FIELDS
    | TOOL_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs"},
    "completion": _COMMON | CONSTRAINT_FIELDS | {"prompt", "echo"},
}
# Fields that change nothing at these values (clients send them by default).
_NO_OP = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None,),
    "store": (False, None),
    "metadata": (None,),
    "service_tier": ("auto", "default", None),
    "suffix": (None, ""),
    "best_of": (1, None),
}


def _check_fields(kind: str, body: dict[str, Any]) -> None:
    """Refuses any field this server does not honour, naming it (400)."""
    for name, value in body.items():
        if name in _FIELDS[kind]:
            continue
        if name in _NO_OP and (value in _NO_OP[name] or value == {}):
            continue
        if name in _NO_OP:
            raise InvalidInputError(f"{name}={value!r}: not supported by this server")
        raise InvalidInputError(f"{name}: not supported by this server; remove the field")


def _sampling(kind: str, body: dict[str, Any], top: int) -> tuple[Sampling, ToolRequest | None]:
    """The sampling parameters (seed drawn later, per choice) and the tools; a forced tool
    choice becomes the constraint."""
    sampling = Sampling(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_get(body, "top_k", int, 0),  # an extension, as in vLLM
        top_logprobs=top,
        constraint=constraint_from_body(body),
    )
    tools = parse_tools(body) if kind == "chat" else None
    sampling = with_tool_constraint(sampling, tools)
    if (problem := sampling.problem()) is not None:
        raise InvalidInputError(problem)
    return sampling, tools


def parse_request(kind: str, body: object, request_id: str) -> OpenAIRequest:
    """Parses a /v1/chat/completions (kind "chat") or /v1/completions body."""
    if not isinstance(body, dict):
        raise InvalidInputError("the request body must be a JSON object")
    _check_fields(kind, body)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise InvalidInputError(f"n={n}: must be in 1..{MAX_N}")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    if kind == "chat":
        logprobs = bool(_get(body, "logprobs", bool, False))
        top = _get(body, "top_logprobs", int, 0)
        if top and not logprobs:
            raise InvalidInputError("top_logprobs: needs logprobs=true")
    else:
        top = _get(body, "logprobs", int, 0)
        logprobs = "logprobs" in body and body["logprobs"] is not None
        if _get(body, "echo", bool, False):
            raise InvalidInputError("echo: not supported")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInputError(f"top_logprobs={top}: must be in 0..{MAX_TOP_LOGPROBS}")
    stream_options = _get(body, "stream_options", dict, {})
    seed = _get(body, "seed", int, None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidInputError(f"seed={seed}: must be in {SEED_MIN}..{SEED_MAX}")
    sampling, tools = _sampling(kind, body, top)
    common = dict(
        model=_get(body, "model", str, ""),
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),  # an extension, as in vLLM
        priority=_get(body, "priority", int, 0),  # an extension, as in vLLM; keys cap it
        disable_speculation=bool(_get(body, "disable_speculation", bool, False)),
    )
    prompt = _prompt(body) if kind == "completion" else None
    messages = _messages(body) if kind == "chat" else None
    inputs = [
        GenerateInput(
            request_id=request_id if n == 1 else f"{request_id}-{i}",
            prompt=prompt,
            messages=messages,
            sampling=replace(sampling, seed=random_seed() if seed is None else (seed + i) % 2**64),
            tools=tools,
            **common,
        )
        for i in range(n)
    ]
    return OpenAIRequest(
        kind=kind,
        inputs=inputs,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        logprobs=logprobs,
        top_logprobs=top,
        model=str(common["model"]),
        user=str(_get(body, "user", str, "")),
    )


# -- responses -----------------------------------------------------------------------------


def usage_json(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True)
class TokenLogprobs:
    """One delta's tokens as text, their logprobs, and the alternatives as (text, logprob)."""

    texts: list[str]
    logprobs: list[float]
    tops: list[list[tuple[str, float]]]


def logprobs_json(req: OpenAIRequest, lp: TokenLogprobs | None) -> dict[str, Any] | None:
    if not req.logprobs or lp is None:
        return None
    if req.kind == "chat":
        return {
            "content": [
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in top
                    ],
                }
                for text, logprob, top in zip(lp.texts, lp.logprobs, lp.tops, strict=True)
            ]
        }
    return {
        "tokens": lp.texts,
        "token_logprobs": lp.logprobs,
        "top_logprobs": [dict(top) for top in lp.tops],
        "text_offset": [],
    }


def chunk_json(
    req: OpenAIRequest, index: int, delta: TextDelta, lp: TokenLogprobs | None, first: bool
) -> dict[str, Any]:
    """One streamed chunk for choice ``index``."""
    choice: dict[str, Any] = {"index": index, "finish_reason": delta.finish_reason}
    if req.kind == "chat":
        choice["delta"] = (
            {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        )
    else:
        choice["text"] = delta.text
    choice["logprobs"] = logprobs_json(req, lp)
    return {
        "id": req.object_id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": delta.model,
        "choices": [choice],
    }


def chunks_json(
    req: OpenAIRequest, index: int, delta: TextDelta, lp: TokenLogprobs | None, first: bool
) -> list[dict[str, Any]]:
    """The streamed chunks of one delta: one, or more when it ends with tool calls."""
    chunk = chunk_json(req, index, delta, lp, first)
    return tool_call_chunks(chunk, delta.tool_calls) if delta.tool_calls else [chunk]


def usage_chunk_json(req: OpenAIRequest, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": req.object_id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": model,
        "choices": [],
        "usage": usage,
    }


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)


def response_json(req: OpenAIRequest, results: list[ChoiceResult]) -> dict[str, Any]:
    """The non-streaming answer: every choice, and usage summed over choices."""
    choices = []
    for i, r in enumerate(results):
        choice: dict[str, Any] = {"index": i, "finish_reason": r.finish_reason}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": r.text}
            if r.tool_calls:  # content is null when the answer is only calls, as in OpenAI
                choice["message"]["content"] = r.text or None
                choice["message"]["tool_calls"] = tool_calls_json(r.tool_calls)
            choice["logprobs"] = (
                {"content": [c for part in r.logprobs for c in part["content"]]}
                if req.logprobs
                else None
            )
        else:
            choice["text"] = r.text
            choice["logprobs"] = _merge_completion_logprobs(r.logprobs) if req.logprobs else None
        choices.append(choice)
    return {
        "id": req.object_id,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": results[0].model,
        "choices": choices,
        "usage": usage_json(
            results[0].prompt_tokens,
            sum(r.completion_tokens for r in results),
            results[0].cached_tokens,
        ),
    }


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    offsets, at = [], 0
    for token in merged["tokens"]:
        offsets.append(at)
        at += len(token)
    merged["text_offset"] = offsets
    return merged
