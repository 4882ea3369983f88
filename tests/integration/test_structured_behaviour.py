"""Structured output and tool calls as OpenAI and vLLM users expect them (issue 34).

The tiny model's weights are random, so each assertion holds by construction of the
grammar: what the model may write is what the test checks.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

import openai
import pytest

from gateway.tools import MAX_PARALLEL_CALLS
from tests.integration.conftest import TinySuite
from tests.support.chat import HELLO, chat, openai_client


@pytest.fixture(scope="module")
def client(suite: TinySuite) -> openai.OpenAI:
    return openai_client(suite.gateway.http_url)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return chat(client, 120, **kwargs)


def test_regex_classes_are_ascii(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = _chat(client, seed=seed, extra_body={"guided_regex": r"\w{16}\s\d{6}"})
        text = reply.choices[0].message.content
        assert re.fullmatch(r"[0-9A-Za-z_]{16}[\t\n\v\f\r ][0-9]{6}", text), text
        assert reply.choices[0].finish_reason == "stop"


def test_regex_unicode_opt_in(client: openai.OpenAI) -> None:
    # with (?u), \d minus 0-9 is every other decimal digit of Unicode
    reply = _chat(client, seed=0, extra_body={"guided_regex": r"(?u)[\d&&[^0-9]]{3}"})
    text = reply.choices[0].message.content
    assert len(text) == 3, text
    assert all(unicodedata.category(c) == "Nd" and not c.isascii() for c in text), text


PING = {"type": "object", "properties": {}, "additionalProperties": False}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "ping", "parameters": PING}},
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
]


def test_a_named_function_is_called_exactly_once(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):  # parallel_tool_calls is left at its default, true
        reply = _chat(client, tools=TOOLS, tool_choice=named, seed=seed, max_tokens=200)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"


def test_required_calls_end_the_turn(client: openai.OpenAI) -> None:
    # 340 tokens hold the longest answer the grammar allows (four weather calls: 279)
    for seed in range(3):
        reply = _chat(client, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=340)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS


def test_required_calls_streamed_end_the_turn(client: openai.OpenAI) -> None:
    chunks = list(
        _chat(client, tools=TOOLS, tool_choice="required", seed=1, max_tokens=340, stream=True)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    named = [
        call.function.name
        for c in chunks
        if c.choices
        for call in c.choices[0].delta.tool_calls or ()
        if call.function and call.function.name
    ]
    assert content == ""
    assert finishes[-1] == "tool_calls"
    assert 1 <= len(named) <= MAX_PARALLEL_CALLS


def test_a_call_cut_by_max_tokens_is_no_content(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 6, "stream": stream}
        if stream:
            chunks = [c for c in _chat(client, **kwargs) if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
            finish = chunks[-1].choices[0].finish_reason
        else:
            (choice,) = _chat(client, **kwargs).choices
            content = choice.message.content or ""
            calls, finish = choice.message.tool_calls or [], choice.finish_reason
        assert (finish, content, calls) == ("length", "", [])


def test_logprob_bytes_are_each_tokens_own(client: openai.OpenAI) -> None:
    # the choice forces the answer's bytes; the tiny vocabulary spells these characters byte
    # by byte, so some tokens hold part of a character (their text alone is U+FFFD)
    word = "日本é"
    for stream in (False, True):
        kwargs = {"logprobs": True, "top_logprobs": 2, "stream": stream}
        reply = _chat(client, extra_body={"guided_choice": [word]}, **kwargs)
        choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.content or ()]
        assert b"".join(bytes(t.bytes) for t in tokens) == word.encode()
        assert any(t.token == "\ufffd" for t in tokens)  # a byte-level token was among them
        for t in tokens:
            for top in t.top_logprobs:
                assert top.bytes is not None and len(top.bytes) >= 1


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_a_schema_without_additional_properties_is_closed(client: openai.OpenAI) -> None:
    # listed properties, no additionalProperties: only {} and {"a": "x"} may come out
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}}
    for seed in range(4):
        reply = _chat(client, seed=seed, response_format=_schema_format(schema))
        (choice,) = reply.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert json.loads(choice.message.content) in ({}, {"a": "x"})


def test_json_cut_by_max_tokens_says_length(client: openai.OpenAI) -> None:
    # the shortest valid answer is longer than max_tokens: it is cut, and says so
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "minLength": 40}},
        "required": ["a"],
    }
    reply = _chat(client, max_tokens=8, response_format=_schema_format(schema))
    (choice,) = reply.choices
    assert choice.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(choice.message.content)
    # the openai client's parse() refuses such an answer rather than parse it
    with pytest.raises(openai.LengthFinishReasonError):
        asked: Any = {"messages": HELLO, "response_format": _schema_format(schema)}
        client.chat.completions.parse(model="tiny", max_tokens=8, **asked)
