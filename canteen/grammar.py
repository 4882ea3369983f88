"""Constraints compiled by a maintained grammar engine (llguidance), cached by content.

The gateway converts a request's constraint to the engine's grammar text before any token
is made (on a preparation thread, never on its event loop), so a schema the converter
refuses is refused with its reason, and ships that text with the request; the worker builds
its matcher straight from it (the one tokenizer-level compile of the grammar, on its compile
threads while its steps run), and a grammar it refuses there fails the request before its
first token with the engine's reason. Callers that want a constraint already being built
wait for that one build. ``compile`` (convert and check) stays for tools' parameters, whose
refusal the gateway names by field.
Each process keeps the compiled grammar in an LRU keyed by the constraint itself, so a schema
seen before costs a dictionary lookup; the worker also keeps a matcher built once per
constraint and hands each sequence a copy of it. Compiles run under the engine's resource
limits (``LLParserLimits``) when given, and several may run at once: only the cache is
locked, never a compile. Every compile counts in ``canteen_grammar_compiles_total`` (by
kind and outcome). No torch here: the gateway imports it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import llguidance
import llguidance.hf
from prometheus_client import Counter

from canteen.json_defaults import engine_schema
from canteen.plan import Constraint
from canteen.regex_dialect import ascii_classes

T = TypeVar("T")

CACHE_SIZE = 512
MAX_ERROR_CHARS = 600
# JSON as OpenAI writes it: one space after separators, no free whitespace (which a model
# could otherwise emit without end). A schema's own "x-guidance" options override these.
JSON_STYLE: Any = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


# Registered by each service on its own registry (gateway/metrics.py, worker/engine/observe.py):
# one count per compile the engine ran, so a cache hit never counts.
GRAMMAR_COMPILES = Counter(
    "canteen_grammar_compiles",
    "Constraints compiled by the grammar engine (cache misses), by kind and outcome",
    ("kind", "outcome"),
    registry=None,
)


class ConstraintError(ValueError):
    """The grammar engine cannot compile a constraint; the message says why."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked against a tokenizer)."""
    matcher = llguidance.LLMatcher
    try:
        if constraint.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, JSON_STYLE)
        if constraint.kind == "json_schema":  # as text: the engine reads it 3x faster
            return matcher.grammar_from_json_schema(_closed(constraint.text), JSON_STYLE)
        if constraint.kind == "regex":
            return matcher.grammar_from_regex(ascii_classes(constraint.text))
        if constraint.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))
        if constraint.kind == "grammar":
            return llguidance.grammar_from("grammar", constraint.text)
    except ValueError as exc:
        raise ConstraintError(f"{constraint.kind}: {_short(str(exc))}") from None
    raise ConstraintError(f"constraint kind {constraint.kind!r} is not known")


def _converted(constraint: Constraint) -> str | ConstraintError:
    """``constraint``'s grammar text, or why not; a regex is also parsed (without the
    tokenizer: microseconds), since a malformed one is a client's common mistake."""
    try:
        grammar = grammar_text(constraint)
    except ConstraintError as exc:
        return exc
    if constraint.kind == "regex":
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            return ConstraintError(f"{constraint.kind}: {_short(error)}")
    return grammar


def _closed(schema_text: str) -> str:
    """The schema, as JSON text, with the defaults of canteen/json_defaults.py; text that is
    not JSON goes to the engine as it is, which names the error."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    return json.dumps(engine_schema(schema))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; safe to call from several threads."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int | None = None,
        eos_ids: list[int] | None = None,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        """``limits``: the engine's bounds on a grammar's size and compile work (its
        defaults when None)."""
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos_ids or None
        )
        self.limits = limits
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, str | ConstraintError] = OrderedDict()
        # grammar text not yet checked against the tokenizer (``convert``), or the refusal
        self._converted: OrderedDict[Constraint, str | ConstraintError] = OrderedDict()
        # one matcher per constraint at its grammar's start, never advanced: copied per use
        self._starts: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._building: dict[Constraint, Future[llguidance.LLMatcher]] = {}

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint``; raises ConstraintError with the reason."""
        return self._cached(self._cache, constraint, self._check)

    def convert(self, constraint: Constraint) -> str:
        """``constraint`` as the engine's grammar text, converted once per content (cached,
        refusals too); raises ConstraintError with the converter's reason. Not checked
        against the tokenizer: the gateway ships this text and the worker's matcher build
        checks it (one compile per process that uses the grammar, not a check and a build).
        Counted in ``canteen_grammar_compiles_total`` as a compile."""
        return self._cached(self._converted, constraint, _converted)

    def _cached(
        self,
        cache: OrderedDict[Constraint, str | ConstraintError],
        constraint: Constraint,
        work: Callable[[Constraint], str | ConstraintError],
    ) -> str:
        """``work(constraint)`` once per content, refusals kept too; each run of ``work``
        counts as a compile. Runs outside the lock: other constraints need not wait."""
        with self._lock:
            found = _lookup(cache, constraint)
        if found is None:
            found = work(constraint)
            outcome = "refused" if isinstance(found, ConstraintError) else "compiled"
            GRAMMAR_COMPILES.labels(constraint.kind, outcome).inc()
            with self._lock:
                _store(cache, constraint, found)
        if isinstance(found, ConstraintError):
            raise found
        return found

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar; raises ConstraintError.

        Built straight from the grammar text (the matcher reports what ``compile`` would
        refuse), so a process that never validated the constraint compiles it once, not
        twice: the text the constraint carries (``converted``, shipped by the gateway), else
        converted here. A refusal is kept by content: the same constraint is refused again
        at once. Callers asking for a constraint that another thread is building wait for that
        build rather than repeat it."""
        with self._lock:
            start = _lookup(self._starts, constraint)
            if start is not None:
                return start.deep_copy()
            building = self._building.get(constraint)
            owner = building is None
            if building is None:
                building = self._building[constraint] = Future()
        if not owner:
            return building.result().deep_copy()
        try:
            start = self._build_start(constraint)
        except BaseException as exc:  # the waiters get it too
            building.set_exception(exc)
            raise
        else:
            building.set_result(start)
        finally:
            with self._lock:
                self._building.pop(constraint, None)
        return start.deep_copy()

    def cached_matcher(self, constraint: Constraint) -> llguidance.LLMatcher | None:
        """A fresh matcher at the start of ``constraint``'s grammar if one was built before
        (a copy, microseconds); None otherwise. Never compiles."""
        with self._lock:
            start = _lookup(self._starts, constraint)
        return None if start is None else start.deep_copy()

    def _build_start(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            known = self._cache.get(constraint)
        if isinstance(known, ConstraintError):
            raise known
        try:
            grammar = known or constraint.converted or grammar_text(constraint)
        except ConstraintError as exc:
            GRAMMAR_COMPILES.labels(constraint.kind, "refused").inc()
            with self._lock:
                _store(self._cache, constraint, exc)
            raise
        # the engine builds its parser with the GIL released
        start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if known is None:
            outcome = "refused" if start.is_error() else "compiled"
            GRAMMAR_COMPILES.labels(constraint.kind, outcome).inc()
        if start.is_error():
            refusal = ConstraintError(f"{constraint.kind}: {_short(start.get_error())}")
            with self._lock:
                _store(self._cache, constraint, refusal)
            raise refusal
        with self._lock:
            _store(self._starts, constraint, start)
        return start

    def _check(self, constraint: Constraint) -> str | ConstraintError:
        try:
            grammar = grammar_text(constraint)
        except ConstraintError as exc:
            return exc
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error:
            return ConstraintError(f"{constraint.kind}: {_short(error)}")
        return grammar


def _lookup(cache: OrderedDict[Constraint, T], constraint: Constraint) -> T | None:
    found = cache.get(constraint)
    if found is not None:
        cache.move_to_end(constraint)
    return found


def _store(cache: OrderedDict[Constraint, T], constraint: Constraint, value: T) -> None:
    cache[constraint] = value
    cache.move_to_end(constraint)
    if len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def _short(message: str) -> str:
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
