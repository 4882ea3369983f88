"""OpenAI's and vLLM's constraint fields of a request body, as one ``Constraint``.

``response_format`` is OpenAI's (``text``, ``json_object``, ``json_schema``); ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` are the request extensions vLLM
users know. A request may carry one of them. What the grammar engine makes of the text is
checked later, with the model's tokenizer (canteen/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

from canteen.plan import Constraint
from gateway.errors import InvalidInputError

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}
CONSTRAINT_FIELDS = frozenset({"response_format", "guided_choice", *_GUIDED})


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
            raise InvalidInputError("guided_choice: expected a list of strings")
        return Constraint("choice", choices=tuple(value))
    if name == "guided_json":
        return Constraint("json_schema", text=_schema_text(name, value))
    if not isinstance(value, str):
        raise InvalidInputError(f"{name}: expected a string, got {type(value).__name__}")
    return Constraint(_GUIDED[name], text=value)


def _response_format(value: object) -> Constraint | None:
    if not isinstance(value, dict):
        raise InvalidInputError("response_format: expected an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise InvalidInputError(
            f"response_format.type={kind!r}: must be 'text', 'json_object' or 'json_schema'"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidInputError("response_format.json_schema: expected an object with a schema")
    if "schema" not in spec:
        raise InvalidInputError("response_format.json_schema.schema: required")
    # strict or not, the schema is enforced: a constrained output always validates
    text = _schema_text("response_format.json_schema.schema", spec["schema"])
    return Constraint("json_schema", text=text)


def _schema_text(name: str, schema: object) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict | bool):
        raise InvalidInputError(f"{name}: expected a JSON schema object")
    return json.dumps(schema, separators=(",", ":"))
