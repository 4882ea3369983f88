"""Real-world schemas through the HTTP edge (issue 34, second part): each distinct constraint
compiles once per process, a schema the engine cannot take is refused with its reason, the
documented JSON defaults hold, and streamed tool calls are the non-streamed ones in pieces.

The tiny model's weights are random: every answer here is the grammar's doing.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.conftest import TinySuite
from tests.support.chat import chat, openai_client


@pytest.fixture(scope="module")
def client(suite: TinySuite) -> openai.OpenAI:
    return openai_client(suite.gateway.http_url)


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _compiles(suite: TinySuite, kind: str) -> float:
    """The gateway's canteen_grammar_compiles_total of ``kind`` that compiled."""
    with urllib.request.urlopen(f"{suite.gateway.http_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    line = f'canteen_grammar_compiles_total{{kind="{kind}",outcome="compiled"}}'
    found = re.search(re.escape(line) + r" (\S+)", text)
    return float(found.group(1)) if found else 0.0


def test_the_same_schema_twice_compiles_once(suite: TinySuite, client: openai.OpenAI) -> None:
    # a schema no other test sends: its first request is a cache miss, its second a hit
    fresh = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "integer"}}}
    before = _compiles(suite, "json_schema")
    for seed in (1, 2):
        reply = chat(client, 60, seed=seed, response_format=_schema_format(fresh))
        jsonschema.validate(json.loads(reply.choices[0].message.content), fresh)
    assert _compiles(suite, "json_schema") == before + 1
    chat(client, 60, seed=3, response_format=_schema_format({**fresh, "title": "other"}))
    assert _compiles(suite, "json_schema") == before + 2  # new content, one more compile


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (
            {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            'json_schema: Unimplemented keys: ["uniqueItems"]',
        ),
        (
            {"type": "object", "properties": {"a": {}}, "propertyNames": {"pattern": "^a"}},
            'json_schema: Unimplemented keys: ["propertyNames"]',
        ),
        (
            {"$ref": "https://json.schemastore.org/package.json"},
            "json_schema: Resource 'https://json.schemastore.org/package.json' is not present",
        ),
    ],
)
def test_a_schema_the_engine_cannot_take_is_refused_with_its_reason(
    client: openai.OpenAI, schema: dict[str, Any], reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, 20, response_format=_schema_format(schema))
    assert info.value.status_code == 400
    assert reason in str(info.value), str(info.value)


def test_a_format_the_engine_does_not_know_is_an_annotation(client: openai.OpenAI) -> None:
    # uri-reference and color are no grammar the engine has: the values are plain strings
    schema = {
        "type": "object",
        "properties": {
            "home": {"type": "string", "format": "uri-reference", "maxLength": 12},
            "when": {"type": "string", "format": "date"},
            "tint": {"type": "string", "format": "color", "maxLength": 8},
        },
        "required": ["home", "when", "tint"],
    }
    for seed in range(3):
        reply = chat(client, 120, seed=seed, response_format=_schema_format(schema))
        (choice,) = reply.choices
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["when"]), value  # known: enforced


def test_json_is_written_as_openai_writes_it(client: openai.OpenAI) -> None:
    # the documented style: ", " and ": " between items, no other whitespace
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"enum": [1, "x", None]}, "maxItems": 4},
            "b": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"]},
        },
        "required": ["a", "b"],
    }
    for seed in range(3):
        text = chat(client, 120, seed=seed, response_format=_schema_format(schema))
        content = text.choices[0].message.content
        assert content == json.dumps(json.loads(content)), content


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {"properties": {}}}},
]


def _streamed_calls(chunks: list[Any]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, joined from the deltas as the openai client does."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            name, args = calls.setdefault(delta.index, ["", ""])
            if delta.function and delta.function.name:
                name += delta.function.name
            if delta.function and delta.function.arguments:
                args += delta.function.arguments
            calls[delta.index] = [name, args]
    return [(name, args) for _, (name, args) in sorted(calls.items())]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_are_the_non_streamed_ones(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    for seed in range(3):
        asked: dict[str, Any] = {"tools": TOOLS, "tool_choice": tool_choice, "seed": seed}
        (whole,) = chat(client, 350, **asked).choices
        chunks = list(chat(client, 350, stream=True, **asked))
        assert whole.finish_reason == "tool_calls"
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert _streamed_calls(chunks) == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        for name, arguments in expected:
            if name == "get_weather":
                jsonschema.validate(json.loads(arguments), WEATHER)
