"""What a JSON schema without ``additionalProperties`` lets the model write.

JSON Schema leaves such an object open: any extra property validates, and a small model
then adds properties until ``max_tokens``. The anchors close it: OpenAI's strict mode
requires ``additionalProperties: false`` on every object, xgrammar (vLLM's default backend)
compiles with ``strict_mode`` on (extra properties and items refused), and vLLM adds
``additionalProperties: false`` for its llguidance backend too. So a schema object that lists
``properties`` (or ``patternProperties``) and says nothing of ``additionalProperties`` or
``unevaluatedProperties`` is closed here; ``"additionalProperties": true`` keeps it open. An
object with no ``properties`` (``{"type": "object"}``, ``json_object``) stays open: it has
nothing else to hold. Every answer under the closed schema still validates against the
schema as written.

``format`` is an annotation in JSON Schema unless a validator is told to assert it (2019-09
and later; the ``jsonschema`` package checks none by default). The engine enforces the formats
it knows (``ENGINE_FORMATS``) and refuses a schema naming any other; such a ``format`` (e.g.
``uri-reference``, ``regex``, ``color``) is dropped here, so the value is a plain string, as a
validator that does not assert formats reads it.
"""

from __future__ import annotations

from typing import Any

# where a schema holds sub-schemas: one, a list of them, or a name -> schema map
_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# the string formats llguidance builds a grammar for (others it refuses as "Unknown format")
ENGINE_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
)


def engine_schema(schema: Any) -> Any:
    """``schema`` as the grammar engine gets it: objects closed (``closed_objects``) and
    formats the engine does not know dropped (a copy; the input is untouched)."""
    return _close(schema, is_part=False, is_engine=True)


def closed_objects(schema: Any) -> Any:
    """``schema`` with its listed-property objects closed (a copy; the input is untouched).
    Members of ``allOf`` are not closed themselves, since each lists only part of the
    properties the intersection allows."""
    return _close(schema, is_part=False, is_engine=False)


def _close(schema: Any, is_part: bool, is_engine: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], False, is_engine)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, False, is_engine) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, True, is_engine) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, False, is_engine) for name, s in out[key].items()}
    if is_engine and isinstance(out.get("format"), str) and out["format"] not in ENGINE_FORMATS:
        del out["format"]  # an annotation the engine cannot enforce
    lists = "properties" in out or "patternProperties" in out
    says = "additionalProperties" in out or "unevaluatedProperties" in out
    if lists and not says and not is_part:
        out["additionalProperties"] = False
    return out
