"""OpenAI wire shapes, the way out: TextDeltas and results in, JSON chunks and bodies out.

The way in (JSON bodies to GenerateInput) is gateway/openai_api.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from canteen.finish import Finish, openai_finish
from gateway.openai_api import OpenAIRequest
from gateway.openai_tools import tool_call_chunks, tool_calls_json
from gateway.output import TextDelta, Usage, request_usage
from gateway.tools import ToolCall


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class TokenLogprobs:
    """One delta's tokens as text, their logprobs, the alternatives as (text, logprob,
    bytes), and each token's own bytes: OpenAI's ``bytes`` are the token's raw bytes, so a
    client can join the pieces of a character that no single token's text can show."""

    texts: list[str]
    logprobs: list[float]
    tops: list[list[tuple[str, float, bytes]]]
    raw: list[bytes]


def logprobs_json(req: OpenAIRequest, lp: TokenLogprobs | None) -> dict[str, Any] | None:
    if not req.logprobs or lp is None:
        return None
    if req.kind == "chat":
        return {
            "content": [
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(raw),
                    "top_logprobs": [
                        {"token": t, "logprob": p, "bytes": list(b)} for t, p, b in top
                    ],
                }
                for text, logprob, top, raw in zip(
                    lp.texts, lp.logprobs, lp.tops, lp.raw, strict=True
                )
            ]
        }
    return {
        "tokens": lp.texts,
        "token_logprobs": lp.logprobs,
        "top_logprobs": [{t: p for t, p, _ in top} for top in lp.tops],
        "text_offset": [],
    }


def chunk_json(
    req: OpenAIRequest, index: int, delta: TextDelta, lp: TokenLogprobs | None, first: bool
) -> dict[str, Any]:
    """One streamed chunk for choice ``index``."""
    choice: dict[str, Any] = {"index": index, "finish_reason": openai_finish(delta.finish_reason)}
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


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event of a JSON payload."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


_SLOT = "canteen-text-slot-5f0c"  # stands for a chunk's text in a template


class ChunkEncoder:
    """A streamed answer's chunks as server-sent events. Most chunks are text alone (not a
    choice's first, not its last, no logprobs): those are a template per choice and model,
    made once, with the text's JSON in its slot: the same bytes as encoding the whole
    chunk, without building and encoding a dict per token."""

    def __init__(self, req: OpenAIRequest) -> None:
        self._req = req
        self._templates: dict[tuple[int, str], tuple[bytes, bytes] | None] = {}

    def encode(self, index: int, delta: TextDelta, lp: TokenLogprobs | None, first: bool) -> bytes:
        if not (first or lp is not None or delta.finish_reason is not None or delta.tool_calls):
            key = (index, delta.model)
            if key not in self._templates:
                self._templates[key] = self._template(index, delta.model)
            template = self._templates[key]
            if template is not None:
                before, after = template
                return before + json.dumps(delta.text, ensure_ascii=False).encode() + after
        return b"".join(sse(c) for c in chunks_json(self._req, index, delta, lp, first))

    def _template(self, index: int, model: str) -> tuple[bytes, bytes] | None:
        """The bytes before and after a text chunk's text; None if the slot's name shows
        elsewhere in the chunk (a model so named): such chunks are encoded whole."""
        slotted = TextDelta(_SLOT, [], model)
        parts = sse(chunk_json(self._req, index, slotted, None, False)).split(
            json.dumps(_SLOT).encode()
        )
        return (parts[0], parts[1]) if len(parts) == 2 else None


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
    finish_reason: Finish | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    model: str = ""
    usage: Usage = field(default_factory=Usage)
    tool_calls: list[ToolCall] = field(default_factory=list)


def response_json(req: OpenAIRequest, results: list[ChoiceResult]) -> dict[str, Any]:
    """The non-streaming answer: every choice, and usage summed over choices."""
    choices = []
    for i, r in enumerate(results):
        choice: dict[str, Any] = {"index": i, "finish_reason": openai_finish(r.finish_reason)}
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
        "usage": usage_json(request_usage([r.usage for r in results])),
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
