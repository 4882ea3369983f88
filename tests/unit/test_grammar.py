"""canteen/grammar.py's compile cache: a constraint seen before (the same content, whatever
the object) costs a lookup, refusals included, and the LRU keeps the most recent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import canteen.grammar
from canteen.grammar import GRAMMAR_COMPILES, ConstraintError, GrammarCompiler
from canteen.plan import Constraint
from gateway.tokenizers import Tokenizer
from tests.support.tiny_model import build_tokenizer

SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}}}'


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(build_tokenizer())


@pytest.fixture
def checks(compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The constraint kinds the engine is asked to compile, in order, on an empty cache."""
    seen: list[str] = []
    real = canteen.grammar.grammar_text

    def counted(constraint: Constraint) -> str:
        seen.append(constraint.kind)
        return real(constraint)

    monkeypatch.setattr(canteen.grammar, "grammar_text", counted)
    monkeypatch.setattr(compiler, "_cache", type(compiler._cache)())
    yield seen


def test_the_same_constraint_is_compiled_once_and_the_cached_object_returned(
    compiler: GrammarCompiler, checks: list[str]
) -> None:
    first = compiler.compile(Constraint("json_schema", text=SCHEMA))
    again = compiler.compile(Constraint("json_schema", text=SCHEMA))  # equal, not the same
    assert again is first
    assert checks == ["json_schema"]
    compiler.compile(Constraint("regex", text="[a-z]+"))
    assert compiler.compile(Constraint("json_schema", text=SCHEMA)) is first
    assert checks == ["json_schema", "regex"]


def test_a_refused_constraint_is_refused_again_without_recompiling(
    compiler: GrammarCompiler, checks: list[str]
) -> None:
    bad = Constraint("grammar", text="start: foo")
    with pytest.raises(ConstraintError) as first:
        compiler.compile(bad)
    with pytest.raises(ConstraintError) as again:
        compiler.compile(Constraint("grammar", text="start: foo"))
    assert again.value is first.value and "foo" in str(first.value)
    assert checks == ["grammar"]


def test_the_cache_evicts_the_least_recently_used(
    compiler: GrammarCompiler, checks: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(canteen.grammar, "CACHE_SIZE", 2)
    a, b, c = (Constraint("choice", choices=(word,)) for word in ("a", "b", "c"))
    compiler.compile(a)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent: c evicts b
    compiler.compile(c)
    compiler.compile(a)
    assert len(checks) == 3
    compiler.compile(b)
    assert len(checks) == 4


def test_the_compile_counter_counts_each_compile_and_no_cache_hit(
    compiler: GrammarCompiler, checks: list[str]
) -> None:
    def count(outcome: str) -> float:
        (family,) = GRAMMAR_COMPILES.collect()
        wanted = {"kind": "regex", "outcome": outcome}
        found = [
            s.value for s in family.samples if s.name.endswith("_total") and s.labels == wanted
        ]
        return float(sum(found))

    compiled, refused = count("compiled"), count("refused")
    for _ in range(3):
        compiler.compile(Constraint("regex", text="[0-9]{4}"))
    for _ in range(2):
        with pytest.raises(ConstraintError):
            compiler.compile(Constraint("regex", text="a(b"))
    assert (count("compiled"), count("refused")) == (compiled + 1, refused + 1)
    assert checks == ["regex", "regex"]


def test_the_gateways_compiles_of_different_constraints_run_at_once() -> None:
    # two preparation threads each wait inside the engine's check for the other: a compile
    # under a lock of the tokenizer (or of the cache) would never let the second one in
    tokenizer = Tokenizer(build_tokenizer())
    both = threading.Barrier(2, timeout=10)
    real = canteen.grammar.grammar_text

    def meeting(constraint: Constraint) -> str:
        both.wait()
        return real(constraint)

    def check(text: str) -> None:
        tokenizer.check_constraint(Constraint("regex", text=text))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(canteen.grammar, "grammar_text", meeting)
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(check, ("[a-c]{3}", "[d-f]{3}"))) == [None, None]
