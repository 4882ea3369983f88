"""Compile once (issue 34): the gateway converts a constraint to the engine's grammar text and
ships it; the worker builds its matcher from that text without converting again, an old
gateway's constraint (no text) is converted by the worker, a worker's refusal is kept by
content, and a client cannot hand the worker a grammar of its own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import llguidance
import pytest

import canteen.grammar
from canteen.codec import sampling_from_pb, sampling_from_request, sampling_to_pb
from canteen.grammar import GRAMMAR_COMPILES, ConstraintError, GrammarCompiler, grammar_text
from canteen.plan import Constraint, Sampling
from canteen.v1 import inference_pb2
from gateway.tokenizers import Tokenizer
from tests.support.tiny_model import build_tokenizer

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})


@pytest.fixture(scope="module")
def hf() -> object:
    return build_tokenizer()


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The constraint kinds converted to grammar text, in order."""
    seen: list[str] = []
    real = canteen.grammar.grammar_text

    def counted(constraint: Constraint) -> str:
        seen.append(constraint.kind)
        return real(constraint)

    monkeypatch.setattr(canteen.grammar, "grammar_text", counted)
    yield seen


def _refused(kind: str) -> float:
    (family,) = GRAMMAR_COMPILES.collect()
    wanted = {"kind": kind, "outcome": "refused"}
    return sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels == wanted)


def _accepts(matcher: llguidance.LLMatcher, tokenizer: Tokenizer, text: str) -> bool:
    return all(matcher.consume_token(t) for t in tokenizer.encode(text))


def test_the_gateway_converts_once_and_never_checks_against_the_tokenizer(
    hf: object, conversions: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_check(*args: object, **kwargs: object) -> str:
        raise AssertionError("the gateway checked the grammar against its tokenizer")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", no_check)
    tokenizer = Tokenizer(hf)
    first = tokenizer.check_constraint(Constraint("json_schema", SCHEMA))
    again = tokenizer.check_constraint(Constraint("json_schema", SCHEMA))  # equal content: cached
    assert first.converted == again.converted == grammar_text(Constraint("json_schema", SCHEMA))
    assert first == Constraint("json_schema", SCHEMA)  # the text is not part of the key
    assert conversions == ["json_schema"]
    # what only a tokenizer-level compile finds is left to the worker's build
    unique = Constraint("json_schema", '{"type": "array", "uniqueItems": true}')
    assert tokenizer.check_constraint(unique).converted
    with pytest.raises(
        ConstraintError, match=r'json_schema: Unimplemented keys: \["uniqueItems"\]'
    ):
        GrammarCompiler(hf).matcher(tokenizer.check_constraint(unique))


def test_the_worker_builds_from_the_shipped_text_without_converting(
    hf: object, conversions: list[str]
) -> None:
    tokenizer = Tokenizer(hf)
    worker = GrammarCompiler(hf)
    # the text says "b+" where the content says "a+": the worker follows the text it got
    shipped = Constraint("regex", "a+", converted=grammar_text(Constraint("regex", "b+")))
    conversions.clear()
    matcher = worker.matcher(shipped)
    assert conversions == []
    assert _accepts(matcher, tokenizer, "bbb")
    assert not _accepts(worker.matcher(shipped), tokenizer, "aaa")


def test_an_old_gateways_constraint_is_converted_by_the_worker(
    hf: object, conversions: list[str]
) -> None:
    tokenizer = Tokenizer(hf)
    worker = GrammarCompiler(hf)
    matcher = worker.matcher(Constraint("regex", "c{2,3}"))
    assert conversions == ["regex"]
    assert _accepts(matcher, tokenizer, "ccc")
    worker.matcher(Constraint("regex", "c{2,3}"))
    assert conversions == ["regex"]  # built before: a copy


def test_a_workers_refusal_is_kept_by_content(hf: object) -> None:
    worker = GrammarCompiler(hf, limits=llguidance.LLParserLimits(initial_lexer_fuel=10))
    open_schema = Constraint("json_schema", SCHEMA)
    shipped = Constraint("json_schema", SCHEMA, converted=grammar_text(open_schema))
    before = _refused("json_schema")
    for constraint in (shipped, open_schema):  # the second finds the first's refusal
        with pytest.raises(ConstraintError, match=r"json_schema: .*\(limit for this grammar: 10\)"):
            worker.matcher(constraint)
    assert _refused("json_schema") == before + 1


def test_the_grammar_text_travels_between_services_but_never_from_a_client() -> None:
    constraint = Constraint("regex", "[0-9]+", converted='{"grammars": []}')
    back = sampling_from_pb(sampling_to_pb(Sampling(constraint=constraint))).constraint
    assert back is not None and back.converted == constraint.converted
    request = inference_pb2.GenerateRequest(model="tiny", prompt="x")
    request.constraint.regex = "[0-9]+"
    request.constraint.grammar_text = '{"grammars": [{"lark_grammar": "start: \\"pwned\\""}]}'
    public = sampling_from_request(request).constraint
    assert public == Constraint("regex", "[0-9]+") and public.converted == ""


def test_a_schema_with_the_gateways_text_is_not_parsed_again_between_services() -> None:
    assert Constraint("json_schema", "{oops").problem() == (
        "json_schema is not valid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)"
    )
    assert Constraint("json_schema", "{oops", converted="{}").problem() is None
