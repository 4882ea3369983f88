"""Grammar work on a worker never pauses the other sequences of its steps (issues 32, 34).

A constrained sequence's grammar compiles on the worker's compile threads, not in the step;
a step never waits for it (the sequence is deferred, and planned again); one that misses its
deadline, or breaks a grammar limit, fails that sequence alone; a step's
masks for all its constrained rows come from one parallel fill, with the tokens each row
would get alone. In process, on the tiny model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch

from canteen.grammar import GrammarCompiler
from canteen.plan import (
    Constraint,
    FailedSequence,
    NewSequence,
    Sampling,
    ScheduledSequence,
    StepPlan,
    StepResult,
)
from tests.support import reference
from worker.config import WorkerConfig
from worker.engine.constrain import GrammarOptions
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model

REGEX = Constraint("regex", r"[a-z]{4}( [a-z]{2,6}){6}\.")
SLOW = Constraint("regex", r"[a-z]{3}( [a-z]{3}){5}\.")  # held by the gate below
PROMPT = [5, 17, 42, 99, 7]
FREE = [3, 1, 4, 1, 5, 9, 2, 6]
PER = 12  # blocks per sequence


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(
        str(tiny_model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
    )


class Gate:
    """Holds every compile of SLOW until released; records the threads that compile it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.threads: list[str] = []


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    real = GrammarCompiler.matcher

    def matcher(compiler: GrammarCompiler, constraint: Constraint) -> llguidance.LLMatcher:
        if constraint != SLOW:
            return real(compiler, constraint)
        held.threads.append(threading.current_thread().name)
        held.started.set()
        held.release.wait(30)
        try:
            return real(compiler, constraint)
        finally:
            held.finished.set()

    monkeypatch.setattr(GrammarCompiler, "matcher", matcher)
    yield held
    held.release.set()  # no compile thread outlives the test


def _new(index: int, seq_id: str, tokens: list[int], sampling: Sampling) -> NewSequence:
    blocks = tuple(range(index * PER, (index + 1) * PER))
    return NewSequence(seq_id, tuple(tokens), sampling, blocks, 0, "", "", len(tokens))


def _decode(runner: ModelRunner, first: int, seq_ids: list[str], steps: int) -> list[StepResult]:
    """``steps`` steps of ``seq_ids``, each planned as the scheduler would: a sequence's
    tokens not yet computed (one while it decodes; its whole part again if it was deferred)."""
    results = []
    for i in range(steps):
        live = [s for s in seq_ids if s in runner.sequences]
        results.append(runner.step(StepPlan(first + i, (), _next(runner, live))))
    return results


def _next(runner: ModelRunner, seq_ids: list[str]) -> tuple[ScheduledSequence, ...]:
    seqs = [runner.sequences[s] for s in seq_ids]
    return tuple(ScheduledSequence(s.seq_id, len(s.tokens) - s.num_computed) for s in seqs)


def _until(runner: ModelRunner, first: int, seq_ids: list[str], num: int) -> list[StepResult]:
    """Decode steps until each of ``seq_ids`` made ``num`` tokens (a deferred step makes
    none), at most ``num`` + 50 steps."""
    results: list[StepResult] = []
    while any(len(_tokens(results, s)) < num for s in seq_ids) and len(results) < num + 50:
        live = [s for s in seq_ids if len(_tokens(results, s)) < num]
        results += _decode(runner, first + len(results), live, 1)
    return results


def _tokens(results: list[StepResult], seq_id: str) -> list[int]:
    return [t.token_id for r in results for t in r.tokens if t.seq_id == seq_id]


def test_the_compile_runs_off_the_step_thread_and_the_tokens_stay(
    loaded: LoadedModel, gate: Gate
) -> None:
    sampling = Sampling(temperature=1.0, seed=11, constraint=SLOW)
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    # step 0 computes 3 of the prompt's 5 tokens: it samples nothing, so it need not wait
    first = runner.step(
        StepPlan(0, (_new(0, "s", PROMPT, sampling),), (ScheduledSequence("s", 3),))
    )
    assert gate.started.wait(10)
    assert not gate.finished.is_set()  # the step returned while its grammar still compiled
    assert not first.failed and not first.tokens
    assert gate.threads == [gate.threads[0]] and gate.threads[0].startswith("grammar-compile")
    gate.release.set()
    rest = _until(runner, 1, ["s"], 15)
    # the same sequence on a worker whose compile was never held
    alone = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    whole = [
        alone.step(StepPlan(0, (_new(0, "s", PROMPT, sampling),), (ScheduledSequence("s", 5),)))
    ]
    whole += _until(alone, 1, ["s"], 15 - len(_tokens(whole, "s")))
    assert _tokens(rest, "s") == _tokens(whole, "s")
    assert len(_tokens(whole, "s")) == 15


def test_a_grammar_past_its_deadline_fails_alone_and_the_free_row_keeps_its_tokens(
    loaded: LoadedModel, gate: Gate, tiny_model_dir: Path
) -> None:
    options = GrammarOptions(compile_timeout=0.2)
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256, grammar=options))
    news = (
        _new(0, "slow", PROMPT, Sampling(0.0, constraint=SLOW)),
        _new(1, "free", FREE, Sampling(0.0)),
    )
    plan = StepPlan(0, news, (ScheduledSequence("slow", 5), ScheduledSequence("free", 8)))
    results = [runner.step(plan)]
    # never waited for: it is deferred, step after step, while the free row makes its tokens
    assert results[0].deferred_seq_ids == ("slow",)
    assert [t.seq_id for t in results[0].tokens] == ["free"]
    while not results[-1].failed and len(results) < 1000:
        live = ["slow", "free"] if len(_tokens(results, "free")) < 20 else ["slow"]
        results += _decode(runner, len(results), live, 1)
    assert results[-1].failed == (
        FailedSequence(
            "slow",
            "sequence slow: regex: its grammar did not compile within "
            "grammar_compile_timeout=0.2s (the worker's --grammar-compile-timeout)",
            is_request_error=True,
        ),
    )
    assert all(r.deferred_seq_ids == ("slow",) for r in results[:-1])
    assert "slow" not in runner.sequences
    made = len(_tokens(results, "free"))
    results += _decode(runner, len(results), ["free"], 24 - made)
    assert _tokens(results, "free") == reference.greedy(tiny_model_dir, FREE, 24)
    # its blocks are free at once
    fresh = (_new(0, "again", PROMPT, Sampling(0.0)),)
    again = runner.step(StepPlan(len(results), fresh, (ScheduledSequence("again", 5),)))
    assert not again.failed and [t.seq_id for t in again.tokens] == ["again"]


def test_a_held_compile_delays_no_other_row_and_its_sequence_continues_exactly(
    loaded: LoadedModel, gate: Gate, tiny_model_dir: Path
) -> None:
    sampling = Sampling(temperature=1.0, seed=11, constraint=SLOW)
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    news = (_new(0, "slow", PROMPT, sampling), _new(1, "free", FREE, Sampling(0.0)))
    results = [
        runner.step(StepPlan(0, news, (ScheduledSequence("slow", 5), ScheduledSequence("free", 8))))
    ]
    assert gate.started.wait(10)
    results += _decode(runner, 1, ["slow", "free"], 15)
    # 16 steps while the compile is held: the free row made a token in each, the other none
    assert not gate.finished.is_set()
    assert _tokens(results, "free") == reference.greedy(tiny_model_dir, FREE, 16)
    assert _tokens(results, "slow") == [] and all(r.deferred_seq_ids == ("slow",) for r in results)
    assert not any(r.failed for r in results)
    gate.release.set()
    rest = _until(runner, 16, ["slow"], 12)
    alone = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    first = alone.step(StepPlan(0, (_new(0, "slow", PROMPT, sampling),), _five("slow")))
    whole = [first, *_until(alone, 1, ["slow"], 12 - len(_tokens([first], "slow")))]
    assert _tokens(rest, "slow") == _tokens(whole, "slow")
    assert len(_tokens(rest, "slow")) == 12


def _five(seq_id: str) -> tuple[ScheduledSequence, ...]:
    return (ScheduledSequence(seq_id, 5),)


@pytest.mark.parametrize(
    ("options", "engine_says", "flag"),
    [
        (
            GrammarOptions(max_grammar_size=30),
            "grammar size (number of symbols) too big (limit for this grammar: 30)",
            "--grammar-max-size",
        ),
        (
            GrammarOptions(lexer_fuel=1000),
            "initial lexer configuration (grammar) too big (limit for this grammar: 1000)",
            "--grammar-lexer-fuel",
        ),
    ],
)
def test_a_grammar_over_a_limit_fails_alone_naming_the_limit(
    loaded: LoadedModel, tiny_model_dir: Path, options: GrammarOptions, engine_says: str, flag: str
) -> None:
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256, grammar=options))
    schema = Constraint(  # open, as JSON Schema has it (closed is the default): a bigger grammar
        "json_schema",
        '{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},'
        '"c":{"type":"array","items":{"type":"number"}}},"required":["a","b","c"],'
        '"additionalProperties":true}',
    )
    news = (
        _new(0, "big", PROMPT, Sampling(0.0, constraint=schema)),
        _new(1, "free", FREE, Sampling(0.0)),
    )
    results = [
        runner.step(StepPlan(0, news, (ScheduledSequence("big", 5), ScheduledSequence("free", 8))))
    ]
    results += _decode(runner, 1, ["big", "free"], 11)  # "big" again while deferred
    while "big" in runner.sequences and len(results) < 500:  # a slow host: its compile too
        results += _decode(runner, len(results), ["big"], 1)
    [failure] = [f for r in results for f in r.failed]
    assert failure.seq_id == "big"
    assert failure.error == f"sequence big: json_schema: {engine_says} (the worker's {flag})"
    assert _tokens(results, "free") == reference.greedy(tiny_model_dir, FREE, 12)
    assert "big" not in runner.sequences


SHAPES = {
    "greedy": (PROMPT, Sampling(0.0, constraint=REGEX)),
    "seeded": ([9, 8, 7, 6], Sampling(temperature=1.0, seed=3, constraint=REGEX)),
    "choice": (
        [11, 12],
        Sampling(
            temperature=0.8,
            seed=5,
            constraint=Constraint("choice", choices=("alpha beta", "gamma", "delta epsilon zeta")),
        ),
    ),
    "json": (
        [40, 41, 42],
        Sampling(
            temperature=1.0,
            seed=8,
            constraint=Constraint(
                "json_schema",
                '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}',
            ),
        ),
    ),
}


def _run_together(loaded: LoadedModel, names: list[str], steps: int) -> dict[str, list[int]]:
    runner = ModelRunner(loaded, RunnerConfig(64, 8, 256))
    news = tuple(_new(i, n, *SHAPES[n]) for i, n in enumerate(names))
    plan = StepPlan(0, news, tuple(ScheduledSequence(n.seq_id, len(n.token_ids)) for n in news))
    first = runner.step(plan)
    made = min(len(_tokens([first], n)) for n in names)
    results = [first, *_until(runner, 1, names, steps - made)]
    assert not any(r.failed for r in results)
    return {n: _tokens(results, n)[:steps] for n in names}


def test_a_step_of_several_constrained_rows_gives_each_its_tokens_alone(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    together = _run_together(loaded, list(SHAPES), 24)
    for name in SHAPES:
        assert together[name] == _run_together(loaded, [name], 24)[name], name
    # and the greedy row is transformers' argmax under the grammar's mask, token by token
    assert together["greedy"] == _masked_greedy(loaded, tiny_model_dir, 24)


def _masked_greedy(loaded: LoadedModel, path: Path, steps: int) -> list[int]:
    """Greedy tokens of SHAPES["greedy"] from transformers, masked by its own matcher."""
    model, hf_tokenizer = reference._load(str(path))
    vocab = int(loaded.model.config.vocab_size)
    compiler = GrammarCompiler(hf_tokenizer, vocab, list(loaded.eos_token_ids))
    matcher = compiler.matcher(REGEX)
    ids, out = list(PROMPT), []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]  # type: ignore[operator]
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if matcher.is_error() or not allowed.any():
            allowed[:] = False
            allowed[list(loaded.eos_token_ids)] = True
        token = int(logits.masked_fill(~torch.from_numpy(allowed), float("-inf")).argmax())
        matcher.consume_token(token)
        ids.append(token)
        out.append(token)
    return out


def test_the_worker_flags_default_to_llguidances_limits_and_are_bounded() -> None:
    default = llguidance.LLParserLimits()
    limits = WorkerConfig().grammar.limits()
    for name in (
        "initial_lexer_fuel",
        "step_lexer_fuel",
        "step_max_items",
        "max_lexer_states",
        "max_grammar_size",
    ):
        assert getattr(limits, name) == getattr(default, name), name
    with pytest.raises(ValueError) as timeout:
        WorkerConfig(grammar_compile_timeout=0)
    assert str(timeout.value) == "grammar_compile_timeout=0: must be in 0.01..600"
    with pytest.raises(ValueError) as threads:
        WorkerConfig(grammar_compile_threads=0)
    assert str(threads.value) == "grammar_compile_threads=0: must be in 1..32"


def test_the_inline_mask_rows_flag_reaches_the_grammar_options_and_is_bounded() -> None:
    assert WorkerConfig().grammar.inline_mask_rows == 16
    assert WorkerConfig(grammar_inline_mask_rows=0).grammar.inline_mask_rows == 0
    with pytest.raises(ValueError) as rows:
        WorkerConfig(grammar_inline_mask_rows=-1)
    assert str(rows.value) == "grammar_inline_mask_rows=-1: must be in 0..4096"
