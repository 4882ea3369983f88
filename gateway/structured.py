"""OpenAI's and vLLM's constraint fields of a request body, as one ``Constraint``.

``response_format`` is OpenAI's (``text``, ``json_object``, ``json_schema``); ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` are the request extensions vLLM
users know. A request may carry one of them. What the grammar engine makes of the text is
checked later, with the model's tokenizer (canteen/grammar.py). A key this module does not
read (``response_format.json_schema.description``, say) is refused naming its path.
"""

from __future__ import annotations

import json
from typing import Any

from canteen.plan import Constraint
from gateway.errors import InvalidInputError, clip, refuse_unknown

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}
CONSTRAINT_FIELDS = frozenset({"response_format", "guided_choice", *_GUIDED})
_FORMAT_KEYS = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "json_schema"}),
}
# OpenAI's json_schema keys but ``description``, which OpenAI shows the model and this server
# would not: it is refused rather than dropped. ``name`` only labels the schema.
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict"})


def constraint_from_body(body: dict[str, Any]) -> Constraint | None:
    """The one constraint a body asks for; None for free text."""
    found = [(name, body[name]) for name in sorted(CONSTRAINT_FIELDS) if body.get(name) is not None]
    constraints = [(name, _parse(name, value)) for name, value in found]
    asked = [(name, c) for name, c in constraints if c is not None]
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise InvalidInputError(f"{names}: give at most one constraint per request")
    return asked[0][1] if asked else None


def _parse(name: str, value: object) -> Constraint | None:
    if name == "response_format":
        return _response_format(value)
    if name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidInputError(
                "guided_choice: expected a list of strings", param="guided_choice"
            )
        return Constraint("choice", choices=tuple(value))
    if name == "guided_json":
        return Constraint("json_schema", text=_schema_text(name, value))
    if not isinstance(value, str):
        raise InvalidInputError(
            f"{name}: expected a string, got {type(value).__name__}", param=name
        )
    return Constraint(_GUIDED[name], text=value)


def _response_format(value: object) -> Constraint | None:
    if not isinstance(value, dict):
        raise InvalidInputError(
            "response_format: expected an object with a type", param="response_format"
        )
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidInputError(
            f"response_format.type={clip(kind)}: must be 'text', 'json_object' or 'json_schema'",
            param="response_format.type",
        )
    # json_schema only goes with its own type: elsewhere it would be dropped
    refuse_unknown("response_format", value, _FORMAT_KEYS[kind])
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    where = "response_format.json_schema"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidInputError(f"{where}: expected an object with a schema", param=where)
    refuse_unknown(where, spec, _JSON_SCHEMA_KEYS)
    if "schema" not in spec:
        raise InvalidInputError(f"{where}.schema: required", param=f"{where}.schema")
    for key, kinds in (("name", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise InvalidInputError(
                f"{where}.{key}: expected a {kinds.__name__}, got {type(spec[key]).__name__}",
                param=f"{where}.{key}",
            )
    # strict or not, the schema is enforced: a constrained output always validates
    text = _schema_text(f"{where}.schema", spec["schema"])
    return Constraint("json_schema", text=text)


def _schema_text(name: str, schema: object) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict | bool):
        raise InvalidInputError(f"{name}: expected a JSON schema object", param=name)
    return json.dumps(schema, separators=(",", ":"))
