"""A plan entry the worker refuses fails that sequence alone, on both sides of the stream."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from canteen.finish import Finish
from canteen.plan import (
    FailedSequence,
    NewSequence,
    Sampling,
    ScheduledSequence,
    StepPlan,
)
from scheduler.sequence import Status
from scheduler.server import STATUS_OF
from scheduler.service import InvalidRequestError, SequenceRefusedError, refusal_of
from tests.support import reference
from tests.unit.test_batcher import FakeWorker, make_scheduler, make_seq
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model

BLOCK = 8


def test_the_scheduler_fails_a_refused_sequence_alone_and_frees_its_blocks() -> None:
    sched, worker = make_scheduler(), FakeWorker(64)
    good, bad = make_seq("good", 6, 4), make_seq("bad", 6, 4)
    sched.add(good)
    sched.add(bad)
    plan = sched.schedule()
    assert plan is not None
    result = worker.step(plan)
    refused = dataclasses.replace(
        result,
        tokens=tuple(t for t in result.tokens if t.seq_id != "bad"),
        failed=(FailedSequence("bad", "sequence bad: token id 99999 outside the vocabulary"),),
    )
    events = sched.update(refused)
    failed = [e for e in events if e.finish is Finish.FAILED]
    assert [e.seq_id for e in failed] == [bad.seq_id]
    assert failed[0].is_refused and bad.status is Status.FINISHED
    assert (
        failed[0].error
        == "worker refused the sequence: sequence bad: token id 99999 outside the vocabulary"
    )
    assert bad.block_ids == [] and sched.running == [good]
    assert sched.pool.num_free == 64 - len(good.block_ids)
    worker.seqs.pop("bad")  # the real worker dropped it when it refused it
    while not good.is_finished:
        step_plan = sched.schedule()
        assert step_plan is not None and "bad" not in step_plan.dropped_seq_ids
        sched.update(worker.step(step_plan))
    assert good.finish is Finish.LENGTH and len(good.output_ids) == 4


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(
        str(tiny_model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
    )


def _new(
    seq_id: str, ids: list[int], blocks: list[int], cached: int = 0, **sampling: float
) -> NewSequence:
    fields: dict[str, Any] = {"temperature": 0.0, **sampling}
    return NewSequence(seq_id, tuple(ids), Sampling(**fields), tuple(blocks), cached)


def _run(runner: ModelRunner, seq_id: str, first: int, steps: int) -> list[int]:
    """Decode ``steps`` more tokens of a sequence whose prefill ran (first token ``first``)."""
    out = [first]
    for i in range(steps):
        result = runner.step(StepPlan(100 + i, scheduled=(ScheduledSequence(seq_id, 1),)))
        out += [t.token_id for t in result.tokens if t.seq_id == seq_id]
    return out


def test_the_worker_refuses_bad_entries_and_runs_the_rest_exactly(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    runner = ModelRunner(loaded, RunnerConfig(16, BLOCK, max_batched_tokens=256))
    prompt = [(i * 11) % 200 + 3 for i in range(12)]
    vocab = runner.vocab_size
    bad = {
        "oov": _new("oov", [5, vocab], [4, 5]),
        "nan": _new("nan", [5, 6], [6], temperature=float("nan")),
        "stolen": _new("stolen", [5, 6], [0]),  # block 0 is the good sequence's
        "outside": _new("outside", [5, 6], [16]),
        "claims": _new("claims", [9] * 10, [7, 8], cached=8),  # block 7 holds nothing of it
    }
    plan = StepPlan(
        1,
        (_new("good", prompt, [0, 1, 2]), *bad.values()),
        tuple(ScheduledSequence(s, n) for s, n in [("good", 12), *((k, 2) for k in bad)]),
    )
    result = runner.step(plan)
    reasons = {f.seq_id: f.error for f in result.failed}
    assert set(reasons) == set(bad)
    assert f"token id {vocab} outside the vocabulary of {vocab}" in reasons["oov"]
    assert "temperature=nan: must be in [0, 2]" in reasons["nan"]
    assert "block 0 is already held by a live sequence" in reasons["stolen"]
    assert "block id 16 outside the pool of 16" in reasons["outside"]
    assert "block 7 does not hold its tokens 0..7" in reasons["claims"]
    assert set(runner.sequences) == {"good"}  # refused ones are forgotten
    [first] = [t.token_id for t in result.tokens]
    assert _run(runner, "good", first, 7) == reference.greedy(tiny_model_dir, prompt, 8)


def test_a_cached_prefix_is_accepted_only_over_blocks_holding_those_tokens(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    runner = ModelRunner(loaded, RunnerConfig(16, BLOCK, max_batched_tokens=256))
    prompt = [(i * 5) % 150 + 7 for i in range(20)]
    runner.step(StepPlan(1, (_new("a", prompt, [0, 1, 2]),), (ScheduledSequence("a", 20),)))
    # "a" finished: its two full blocks keep their contents; "b" shares them as cached.
    result = runner.step(
        StepPlan(
            2,
            (_new("b", prompt, [0, 1, 3, 4], cached=16),),
            (ScheduledSequence("b", 4),),
            dropped_seq_ids=("a",),
        )
    )
    assert result.failed == ()
    [first] = [t.token_id for t in result.tokens]
    assert _run(runner, "b", first, 5) == reference.greedy(tiny_model_dir, prompt, 6)
    # A different prompt may not claim them.
    other = [*prompt[:8], 1, *prompt[9:]]
    refused = runner.step(
        StepPlan(3, (_new("c", other, [0, 1, 5], cached=16),), (ScheduledSequence("c", 4),))
    )
    assert [f.seq_id for f in refused.failed] == ["c"]
    assert "block 1 does not hold its tokens 8..15" in refused.failed[0].error


@pytest.mark.parametrize(
    ("is_request_error", "error_type", "code"),
    [
        (True, InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
        (False, SequenceRefusedError, grpc.StatusCode.INTERNAL),
    ],
)
def test_a_refusal_reaches_the_caller_as_its_own_fault_or_the_plans(
    is_request_error: bool, error_type: type[Exception], code: grpc.StatusCode
) -> None:
    sched, worker = make_scheduler(), FakeWorker(64)
    seq = make_seq("shaped", 6, 4)
    sched.add(seq)
    plan = sched.schedule()
    assert plan is not None
    why = "sequence shaped: regex: its grammar did not compile within 0.2s"
    result = dataclasses.replace(
        worker.step(plan), tokens=(), failed=(FailedSequence("shaped", why, is_request_error),)
    )
    (event,) = sched.update(result)
    error = refusal_of(event)
    assert type(error) is error_type and str(error) == f"worker refused the sequence: {why}"
    assert STATUS_OF[type(error)] == code  # not UNKNOWN: the scheduler names the fault
