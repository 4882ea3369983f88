"""canteen bench arithmetic on hand-built records: percentiles, goodput, TPOT, capacity."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from canteen.tools.bench import (
    Concurrency,
    DatasetError,
    LevelFigures,
    Limits,
    NoLevelMeetsSloError,
    Rate,
    RequestRecord,
    RequestSpec,
    Slo,
    Workload,
    load_jsonl,
    num_instances,
    percentile,
    plan_capacity,
    poisson_gaps,
    random_workload,
    report_to_dict,
    run_with,
    runs_from_dict,
    shared_prefix_workload,
    summarize,
)
from canteen.tools.bench.clients import _apply_chunk, _Timer
from canteen.tools.bench.workload import sample_lengths


def rec(
    i: int, ttft: float, e2e: float, out: int, prompt: int = 10, error: str | None = None
) -> RequestRecord:
    r = RequestRecord(i, max_tokens=out, ttft=ttft, prompt_tokens=prompt, completion_tokens=out)
    if error is None:
        r.e2e = e2e
        r.itl = [(e2e - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    else:
        r.error = error
    return r


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert rec(0, 0.5, 2.5, 5).tpot == pytest.approx(0.5)
    assert rec(1, 0.5, 0.5, 1).tpot is None  # one token: no decode time to divide
    assert rec(2, 0.5, 0.0, 5, error="UNAVAILABLE").tpot is None


def test_summary_throughput_percentiles_and_errors() -> None:
    records = [rec(i, ttft=0.1 * (i + 1), e2e=1.0 + i, out=4) for i in range(10)]
    records.append(rec(10, 0.1, 0.0, 4, error="RESOURCE_EXHAUSTED"))
    records.append(rec(11, 0.1, 0.0, 4, error="HTTP 503"))
    s = summarize(records, duration=4.0, slo=Slo())
    assert (s.num_completed, s.num_failed) == (10, 2)
    assert s.errors == {"HTTP 503": 1, "RESOURCE_EXHAUSTED": 1}
    assert s.total_output_tokens == 40 and s.total_input_tokens == 100
    assert s.request_throughput == pytest.approx(10 / 4)
    assert s.output_throughput == pytest.approx(40 / 4)
    assert s.total_token_throughput == pytest.approx(140 / 4)
    assert s.goodput is None
    assert s.ttft is not None and s.e2e is not None
    # linear interpolation over 0.1..1.0: p50 = 0.55, p90 = 0.91, p99 = 0.991
    assert (s.ttft.p50, s.ttft.p90, s.ttft.p99) == pytest.approx((0.55, 0.91, 0.991))
    assert s.ttft.mean == pytest.approx(0.55)
    assert s.e2e.mean == pytest.approx(5.5)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError, match="percentile"):
        percentile([], 50)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        rec(0, ttft=0.1, e2e=1.1, out=11),  # tpot 0.1: meets both
        rec(1, ttft=0.3, e2e=1.3, out=11),  # ttft misses
        rec(2, ttft=0.1, e2e=3.1, out=11),  # tpot 0.3 misses
        rec(3, ttft=0.2, e2e=0.2, out=1),  # one token: no tpot, ttft meets
        rec(4, ttft=0.1, e2e=0.0, out=11, error="DEADLINE_EXCEEDED"),
    ]
    both = summarize(records, duration=2.0, slo=Slo(ttft=0.25, tpot=0.2))
    assert both.goodput == pytest.approx(2 / 2.0)
    only_ttft = summarize(records, duration=2.0, slo=Slo(ttft=0.25))
    assert only_ttft.goodput == pytest.approx(3 / 2.0)
    with pytest.raises(ValueError, match="slo ttft=0"):
        Slo(ttft=0)


def test_poisson_gaps_have_mean_one_over_rate_and_repeat_by_seed() -> None:
    gaps = poisson_gaps(4.0, 200_000, seed=7)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.01)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.02)  # exponential: std == mean
    assert poisson_gaps(4.0, 5, seed=7) == gaps[:5]
    assert poisson_gaps(4.0, 5, seed=8) != gaps[:5]


def test_random_lengths_stay_in_range() -> None:
    rng = np.random.default_rng(0)
    lengths = sample_lengths(rng, 128, 0.5, 5000)
    assert min(lengths) == 64 and max(lengths) == 192
    assert sample_lengths(rng, 10, 0.0, 3) == [10, 10, 10]
    w = random_workload(300, input_len=40, output_len=16, range_ratio=0.25, seed=3)
    assert all(30 <= s.prompt_len <= 50 and 12 <= s.max_tokens <= 20 for s in w.requests)
    # one word per token at tokens_per_word=1; at 2 tokens a word, half the words
    assert all(len(s.prompt.split()) == s.prompt_len for s in w.requests)
    w2 = random_workload(10, input_len=40, output_len=16, seed=3, tokens_per_word=2.0)
    assert all(len(s.prompt.split()) == round(s.prompt_len / 2) for s in w2.requests)
    assert random_workload(10, 40, 16, seed=3) == random_workload(10, 40, 16, seed=3)
    with pytest.raises(ValueError, match=r"range_ratio=1\.5"):
        random_workload(1, 8, 8, range_ratio=1.5)


def test_shared_prefix_requests_share_the_prefix() -> None:
    w = shared_prefix_workload(20, prefix_len=50, input_len=10, output_len=4, seed=1)
    prefixes = {s.prompt.split("\n\n")[0] for s in w.requests}
    assert len(prefixes) == 1
    assert len({s.prompt for s in w.requests}) == 20
    assert all(s.prompt_len == 50 + 10 for s in w.requests)


def test_jsonl_reads_prompts_and_names_the_bad_line(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"prompt": "there"}\n')
    w = load_jsonl(good, default_max_tokens=9)
    assert w.requests == (RequestSpec("hi", 3), RequestSpec("there", 9))
    assert [s.prompt for s in w.take(5)] == ["hi", "there", "hi", "there", "hi"]
    cases = {
        '{"prompt": "ok"}\n{"max_tokens": 3}\n': r"bad.jsonl:2: field 'prompt'",
        '{"prompt": "ok"}\n\n{"max_tokens": 0, "prompt": "x"}\n': r"bad.jsonl:3: field 'max_",
        '{"prompt": "x", "max_tokens": "5"}\n': r"bad.jsonl:1: field 'max_tokens'",
        '{"prompt": "ok"}\n{"prompt": \n': r"bad.jsonl:2: not JSON",
        "[1, 2]\n": r"bad.jsonl:1: expected a JSON object",
    }
    bad = tmp_path / "bad.jsonl"
    for text, message in cases.items():
        bad.write_text(text)
        with pytest.raises(DatasetError, match=message):
            load_jsonl(bad, 4)
    with pytest.raises(DatasetError, match=r"missing\.jsonl"):
        load_jsonl(tmp_path / "missing.jsonl", 4)


def level(c: int, ttft: float, e2e: float, failed: int = 0) -> LevelFigures:
    return LevelFigures(c, ttft, e2e, request_throughput=c / e2e, num_failed=failed)


def test_capacity_takes_the_highest_level_within_the_slo() -> None:
    levels = [level(1, 0.05, 0.5), level(2, 0.08, 0.6), level(4, 0.2, 0.8), level(8, 0.9, 1.5)]
    plan = plan_capacity(levels, qps=30, slo_ttft=0.25)
    assert plan.level.concurrency == 4
    assert plan.num_instances == math.ceil(30 * 0.8 / 4) == 6
    assert plan.per_instance_qps == pytest.approx(5.0)
    # a failing level does not qualify even when its TTFT does
    plan = plan_capacity([*levels[:2], level(4, 0.2, 0.8, failed=1)], qps=30, slo_ttft=0.25)
    assert plan.level.concurrency == 2 and plan.num_instances == 9
    assert num_instances(10, 0.2, 1) == 2  # exactly 2.0, not 3 from float error
    assert num_instances(0.1, 0.2, 8) == 1


def test_capacity_names_the_best_ttft_when_no_level_meets_the_slo() -> None:
    levels = [level(1, 0.4, 0.5), level(2, 0.3, 0.6), level(4, 0.7, 0.8)]
    with pytest.raises(NoLevelMeetsSloError, match=r"best measured p90 TTFT 0.3000 s at conc") as e:
        plan_capacity(levels, qps=10, slo_ttft=0.1)
    assert e.value.best == levels[1]
    with pytest.raises(NoLevelMeetsSloError, match="no level completed"):
        plan_capacity([], qps=10, slo_ttft=0.1)


def test_http_chunks_fill_tokens_usage_and_errors() -> None:
    record = RequestRecord(0, 3)
    timer = _Timer(record, 0.0)
    _apply_chunk({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}, timer)
    _apply_chunk({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, timer)
    _apply_chunk({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, timer)
    _apply_chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, timer)
    assert record.ttft is not None and len(record.itl) == 1
    assert (record.prompt_tokens, record.completion_tokens) == (7, 3)
    _apply_chunk({"error": {"message": "full", "code": "RESOURCE_EXHAUSTED"}}, timer)
    assert (record.error, record.detail) == ("RESOURCE_EXHAUSTED", "full")


class FakeClient:
    """Answers every request with its max_tokens after a few loop turns; counts in flight."""

    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = 0

    async def send(self, spec: RequestSpec, record: RequestRecord, t0: float) -> None:
        timer = _Timer(record, t0)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(spec.max_tokens):
            await asyncio.sleep(0)
            timer.token()
        if spec.prompt == "boom":
            raise ConnectionError("reset")
        record.prompt_tokens, record.completion_tokens = 5, spec.max_tokens
        self.in_flight -= 1
        timer.finish()

    async def count_tokens(self, text: str) -> int:
        return len(text.split())


async def test_concurrency_mode_keeps_n_in_flight_and_the_report_round_trips() -> None:
    client = FakeClient()
    workload = Workload("t", tuple(RequestSpec(f"p{i}", 2 + i % 3) for i in range(5)))
    limits = Limits(num_requests=20, progress=False, slo=Slo(ttft=10.0))
    run = await run_with(client, workload, Concurrency(3), limits)
    assert client.max_in_flight == 3
    assert run.summary.num_completed == 20 and run.summary.num_failed == 0
    assert [r.completion_tokens for r in run.records] == [2 + i % 5 % 3 for i in range(20)]
    assert all(len(r.itl) == r.completion_tokens - 1 for r in run.records)
    assert run.summary.goodput == pytest.approx(20 / run.duration)
    (back,) = runs_from_dict(json.loads(json.dumps(report_to_dict([run]))))
    assert back.summary == run.summary and back.mode == Concurrency(3)


async def test_rate_mode_sends_everything_and_a_broken_request_is_a_failure() -> None:
    workload = Workload("t", (RequestSpec("ok", 2), RequestSpec("boom", 2)))
    run = await run_with(FakeClient(), workload, Rate(1e6, seed=1), Limits(6, progress=False))
    assert (run.summary.num_completed, run.summary.num_failed) == (3, 3)
    assert run.summary.errors == {"ConnectionError": 3}
    assert [r.detail for r in run.records if r.error] == ["reset"] * 3
