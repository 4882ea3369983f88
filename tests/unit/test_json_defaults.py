"""A schema object that lists properties and says nothing of more is closed by default."""

from __future__ import annotations

import json
from typing import Any

import pytest

from canteen.grammar import GrammarCompiler
from canteen.json_defaults import ENGINE_FORMATS, closed_objects, engine_schema
from canteen.plan import Constraint
from tests.support.tiny_model import build_tokenizer

A = {"a": {"enum": ["x"]}}


def test_listed_properties_close_the_object_at_every_depth() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"properties": A}, "properties": {"type": "string"}},
        "$defs": {"d": {"properties": A}},
        "anyOf": [{"properties": A}],
        "items": {"patternProperties": {"^x": {}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    # a property named "properties" is a property, not a schema keyword: left as given
    assert closed["properties"]["properties"] == {"type": "string"}
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is untouched


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # nothing listed: json_object's schema stays open
        {"properties": A, "additionalProperties": True},
        {"properties": A, "additionalProperties": {"type": "integer"}},
        {"properties": A, "unevaluatedProperties": False},
    ],
)
def test_what_the_schema_says_is_kept(schema: dict[str, Any]) -> None:
    assert closed_objects(schema) == schema


def test_all_of_members_stay_open_for_the_intersection() -> None:
    closed = closed_objects({"allOf": [{"properties": A}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in part for part in closed["allOf"])


def _accepts(compiler: GrammarCompiler, schema: dict[str, Any], text: str) -> bool:
    matcher = compiler.matcher(Constraint("json_schema", text=json.dumps(schema)))
    ids = build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


def test_the_grammar_refuses_an_extra_property_unless_asked_for() -> None:
    compiler = GrammarCompiler(build_tokenizer())
    extra = '{"a": "x", "b": 1}'
    assert _accepts(compiler, {"properties": A}, '{"a": "x"}')
    assert not _accepts(compiler, {"properties": A}, extra)
    assert _accepts(compiler, {"properties": A, "additionalProperties": True}, extra)


def test_formats_the_engine_does_not_know_are_dropped_and_known_ones_kept() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "format": "uri-reference"},
            "b": {"type": "array", "items": {"type": "string", "format": "date"}},
        },
        "$defs": {"c": {"anyOf": [{"format": "color"}, {"format": "uuid"}]}},
    }
    out = engine_schema(schema)
    assert out["properties"]["a"] == {"type": "string"}
    assert out["properties"]["b"]["items"] == {"type": "string", "format": "date"}
    assert out["$defs"]["c"]["anyOf"] == [{}, {"format": "uuid"}]
    assert out["additionalProperties"] is False
    assert closed_objects(schema)["properties"]["a"]["format"] == "uri-reference"
    assert schema["properties"]["a"]["format"] == "uri-reference"  # the input is untouched


@pytest.mark.parametrize("name", sorted(ENGINE_FORMATS))
def test_every_kept_format_compiles(name: str) -> None:
    schema = json.dumps({"type": "string", "format": name})
    GrammarCompiler(build_tokenizer()).compile(Constraint("json_schema", text=schema))
