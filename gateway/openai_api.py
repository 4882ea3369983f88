"""OpenAI wire shapes, the way in: JSON bodies in, GenerateInput out (the way out, TextDeltas
to JSON chunks, is gateway/openai_responses.py).

Only translation lives here; the request path is gateway/service.py. Every field of a body
is honoured or refused: an unknown field, or a nested key this server does not read
(``stream_options.foo``, ``messages[1].foo``, ``tools[0].function.foo``), is a 400 naming
its path, never silently dropped; a few fields OpenAI's clients may send pass only at
values that change nothing (``_NO_OP``). A known field of the wrong type or range is refused
with a message naming it and the limit. The error's ``param`` names the field.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from canteen.codec import random_seed
from canteen.plan import MAX_TOP_LOGPROBS, Sampling
from gateway.errors import InvalidInputError, clip, refuse_unknown
from gateway.openai_messages import check_text, parse_messages
from gateway.openai_tools import TOOL_FIELDS, parse_tools
from gateway.service import GenerateInput
from gateway.structured import CONSTRAINT_FIELDS, constraint_from_body
from gateway.tools import ToolRequest, with_tool_constraint

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
    got = "a boolean" if isinstance(value, bool) else type(value).__name__
    is_bool_ok = bool in (kinds if isinstance(kinds, tuple) else (kinds,))
    if not isinstance(value, kinds) or (isinstance(value, bool) and not is_bool_ok):
        raise InvalidInputError(f"{name}: expected {_kind_name(kinds)}, got {got}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = _get(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range (JSON allows any digits)
        raise InvalidInputError(f"{name}: the number is too large", param=name) from None


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        dict: "an object",
    }
    ks = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(names.get(k, k.__name__) for k in ks)


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidInputError(
            "prompt: expected a string (or a list of exactly one string)", param="prompt"
        )
    return check_text(prompt, "prompt")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [check_text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [check_text(s, f"stop[{i}]") for i, s in enumerate(stop)]
    raise InvalidInputError("stop: expected a string or a list of strings", param="stop")


# Fields each endpoint honours; anything else is refused by name, never silently dropped.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "seed", "logprobs", "user", "ignore_eos", "priority", "disable_speculation",
    "stream_interval",
}  # fmt: skip
_FIELDS = {
    "chat": _COMMON
    | CONSTRAINT_FIELDS
    | TOOL_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs"},
    "completion": _COMMON | CONSTRAINT_FIELDS | {"prompt", "echo"},
}
# Fields that change nothing at these values (clients send them by default): the type a
# value must have, and the values that pass; null always passes.
_NO_OP: dict[str, tuple[type | tuple[type, ...], tuple[object, ...]]] = {
    "presence_penalty": ((int, float), (0,)),
    "frequency_penalty": ((int, float), (0,)),
    "logit_bias": (dict, ({},)),
    "store": (bool, (False,)),
    "metadata": (dict, ({},)),
    "service_tier": (str, ("auto", "default")),
    "suffix": (str, ("",)),
    "best_of": (int, (1,)),
}
_STREAM_OPTIONS = frozenset({"include_usage"})


def _check_fields(kind: str, body: dict[str, Any]) -> None:
    """Refuses any field this server does not honour, naming it (400)."""
    for name, value in body.items():
        if name in _FIELDS[kind]:
            continue
        if name not in _NO_OP:
            raise InvalidInputError(
                f"{name[:64]}: not supported by this server; remove the field", param=name[:64]
            )
        kinds, passing = _NO_OP[name]
        if _get(body, name, kinds, None) not in (None, *passing):
            raise InvalidInputError(
                f"{name}={clip(value)}: not supported by this server (only "
                f"{' or '.join(repr(v) for v in passing)}, which change nothing)",
                param=name,
            )


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    """``stream_options.include_usage``; the options need ``stream: true``, as in OpenAI."""
    options = _get(body, "stream_options", dict, None)
    if options is None:
        return False
    if not stream:
        raise InvalidInputError(
            "stream_options: only allowed with stream: true", param="stream_options"
        )
    refuse_unknown("stream_options", options, _STREAM_OPTIONS)
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidInputError(
            f"stream_options.include_usage: expected a boolean, got {type(include_usage).__name__}",
            param="stream_options.include_usage",
        )
    return bool(include_usage)


def _max_tokens(body: dict[str, Any]) -> int | None:
    """``max_completion_tokens`` or its older name ``max_tokens``; both only when equal."""
    newer = _get(body, "max_completion_tokens", int, None)
    older = _get(body, "max_tokens", int, None)
    if newer is not None and older is not None and newer != older:
        raise InvalidInputError(
            f"max_completion_tokens={newer} and max_tokens={older}: give one of them",
            param="max_tokens",
        )
    return older if newer is None else int(newer)


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


def _logprobs(kind: str, body: dict[str, Any]) -> tuple[bool, int]:
    """Whether logprobs are asked for, and how many alternatives per token."""
    if kind == "chat":
        logprobs = bool(_get(body, "logprobs", bool, False))
        top = _get(body, "top_logprobs", int, 0)
        if top and not logprobs:
            raise InvalidInputError("top_logprobs: needs logprobs=true", param="top_logprobs")
    else:
        top = _get(body, "logprobs", int, 0)
        logprobs = "logprobs" in body and body["logprobs"] is not None
        if _get(body, "echo", bool, False):
            raise InvalidInputError("echo: not supported", param="echo")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInputError(
            f"top_logprobs={top}: must be in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    return logprobs, top


def parse_request(kind: str, body: object, request_id: str) -> OpenAIRequest:
    """Parses a /v1/chat/completions (kind "chat") or /v1/completions body."""
    if not isinstance(body, dict):
        raise InvalidInputError("the request body must be a JSON object")
    _check_fields(kind, body)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise InvalidInputError(f"n={n}: must be in 1..{MAX_N}", param="n")
    logprobs, top = _logprobs(kind, body)
    stream = bool(_get(body, "stream", bool, False))
    include_usage = _include_usage(body, stream)
    seed = _get(body, "seed", int, None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidInputError(f"seed={seed}: must be in {SEED_MIN}..{SEED_MAX}", param="seed")
    sampling, tools = _sampling(kind, body, top)
    common = dict(
        model=_get(body, "model", str, ""),
        max_tokens=_max_tokens(body),
        stop=_stop(body),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),  # an extension, as in vLLM
        priority=_get(body, "priority", int, 0),  # an extension, as in vLLM; keys cap it
        disable_speculation=bool(_get(body, "disable_speculation", bool, False)),
        # an extension, as in SGLang: tokens per streamed chunk (0: the gateway's default)
        stream_interval=_get(body, "stream_interval", int, 0),
    )
    prompt = _prompt(body) if kind == "completion" else None
    messages = parse_messages(body.get("messages")) if kind == "chat" else None
    inputs = [
        GenerateInput(
            request_id=request_id if n == 1 else f"{request_id}-{i}",
            prompt=prompt,
            messages=messages,
            sampling=replace(sampling, seed=random_seed() if seed is None else (seed + i) % 2**64),
            tools=tools,
            is_sampling_checked=True,
            **common,
        )
        for i in range(n)
    ]
    return OpenAIRequest(
        kind=kind,
        inputs=inputs,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top,
        model=str(common["model"]),
        user=str(_get(body, "user", str, "")),
    )
