"""Speculative decoding through the whole suite: the tokens are exactly those without it.

Two workers run ``--speculative ngram`` over a small KV pool (so preemption happens), and
prompts repeat themselves (so drafts are found and accepted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support import reference
from tests.support.stack import Stack
from tests.support.streams import Stream, until
from tests.support.suite import TRANSFORMERS_DTYPE, Suite, wait_serving

WORKER_ARGS = (
    "--speculative", "ngram", "--num-speculative-tokens", "4", "--num-kv-blocks", "48",
    "--block-size", "8", "--threads", "1",
)  # fmt: skip
REPEAT = "the king and the queen of the land far away, " * 2
DRAFTED = "canteen_speculative_draft_tokens_total"
ACCEPTED = "canteen_speculative_accepted_tokens_total"
T = TypeVar("T")


class Spec(Stack):
    def complete(self, prompt: str, max_tokens: int, **fields: Any) -> list[int]:
        request = inference_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, **fields)
        with grpc.insecure_channel(self.gateway.address) as channel:
            reply = inference_pb2_grpc.InferenceStub(channel).Complete(request, timeout=120)
        return list(reply.token_ids)

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.scheduler.metrics_url, timeout=5).read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )

    def drafting(self, run: Callable[[], T], counter: str = DRAFTED) -> T:
        """What ``run()`` returns, from a run during which the workers' ``counter`` grew.
        Whether a step drafts is the scheduler's rule's call, made on measured step times (a
        busy host can make drafting steps look slow for a while), so ``run``, which returns
        the same every time, runs again until the counter grows with it, for up to a minute."""
        deadline = time.monotonic() + 60
        while True:
            before = self.metric(counter)
            result = run()
            if self.metric(counter) > before:
                return result
            assert time.monotonic() < deadline, f"{counter} did not grow in a minute"

    def complete_undrafted(self, prompt: str, max_tokens: int, **fields: Any) -> list[int]:
        """The tokens of a request with ``disable_speculation``: no draft verified for it."""
        before = self.metric(DRAFTED)
        tokens = self.complete(prompt, max_tokens, disable_speculation=True, **fields)
        assert self.metric(DRAFTED) == before, f"disable_speculation verified drafts: {prompt!r}"
        return tokens


@contextmanager
def _spec_suite(
    workdir: Path, tiny_model_dir: Path, names: tuple[str, ...], args: tuple[str, ...] = WORKER_ARGS
) -> Iterator[Spec]:
    s = Suite(workdir)
    try:
        registry = s.start_tiny_registry(tiny_model_dir, "--lease-ttl", "2")
        scheduler = s.start_scheduler(
            registry, "--max-step-stall", "0", "--failover-wait", "20", "--worker-timeout", "10"
        )
        workers = {name: s.start_worker(registry, "tiny", *args, name=name) for name in names}
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateway = s.start_gateway(registry, scheduler)
        yield Spec(s, registry, scheduler, gateway, workers)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spec]:
    workdir = tmp_path_factory.mktemp("speculative")
    with _spec_suite(workdir, tiny_model_dir, ("worker-a", "worker-b")) as suite:
        yield suite


def _prompts(n: int) -> list[str]:
    return [
        f"{REPEAT} story {i}: {REPEAT}" if i % 2 else f"Story number {i} begins" for i in range(n)
    ]


def test_sixteen_mixed_greedy_streams_equal_each_served_alone_without_drafts(spec: Spec) -> None:
    """In the default dtype: verified drafts in a batch of 16 give the tokens of plain
    decoding, each request served alone on an idle suite."""
    prompts = _prompts(16)

    def run() -> list[list[int]]:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            return list(
                pool.map(lambda p: spec.complete(p, 40, temperature=0, ignore_eos=True), prompts)
            )

    outputs = spec.drafting(run, ACCEPTED)
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == spec.complete_undrafted(prompt, 40, temperature=0, ignore_eos=True), prompt


def test_seeded_sampling_is_the_same_with_and_without_speculation(spec: Spec) -> None:
    for i, prompt in enumerate(_prompts(4)):
        fields = {"temperature": 0.9, "seed": 100 + i, "ignore_eos": True}
        off = spec.complete_undrafted(prompt, 48, **fields)
        # drafts verified (at this temperature the tiny model's rarely hold: the unit tests
        # check sampled tokens that accept drafts)
        assert spec.drafting(partial(spec.complete, prompt, 48, **fields)) == off, prompt


def test_max_tokens_and_stop_strings_cut_inside_accepted_runs(spec: Spec) -> None:
    prompt = _prompts(2)[1]
    whole = spec.complete(prompt, 60, temperature=0, ignore_eos=True)
    for n in (1, 2, 3, 5, 7, 11):
        assert spec.complete(prompt, n, temperature=0, ignore_eos=True) == whole[:n]
    with grpc.insecure_channel(spec.gateway.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        full = stub.Complete(
            inference_pb2.GenerateRequest(
                prompt=prompt, max_tokens=60, temperature=0, ignore_eos=True
            )
        ).text
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        cut = stub.Complete(
            inference_pb2.GenerateRequest(
                prompt=prompt, max_tokens=60, temperature=0, ignore_eos=True, stop=[stop]
            )
        )
    assert cut.text == full[: full.index(stop)]


def _sigkill_mid_run(spec: Spec, prompts: list[str]) -> tuple[int, int]:
    """Eight seeded streams on the two workers; the busier worker is SIGKILLed mid-run and
    restarted after. Asserts every stream ends with exactly the tokens of a plain run, and
    returns what the survivor did after the kill: (preemptions, draft tokens verified)."""
    until(lambda: len(spec.stats()) == 2, 60, "both workers linked")
    streams = [Stream(spec.gateway.address, p, 120, seed=7 + i) for i, p in enumerate(prompts)]
    for s in streams:
        s.start()
    until(lambda: all(len(s.tokens) >= 6 for s in streams), 60, "every stream to start")
    running = {wid: w.num_running for wid, w in spec.stats().items()}
    victim = max(running, key=lambda wid: running[wid])
    assert running[victim] > 0, running
    survivor = next(w for w in running if w != victim)
    before = spec.stats()[survivor]
    spec.workers[victim].process.send_signal(signal.SIGKILL)
    for s in streams:
        s.join(120)
    after = spec.stats()[survivor]
    for s, prompt in zip(streams, prompts, strict=True):
        assert s.error is None, s.error
        alone = spec.complete_undrafted(prompt, 120, temperature=1.0, seed=s.seed, ignore_eos=True)
        assert s.tokens == alone, prompt
    spec.workers[victim] = spec.suite.start_worker(spec.registry, "tiny", *WORKER_ARGS, name=victim)
    return (
        after.num_preemptions - before.num_preemptions,
        after.num_draft_tokens - before.num_draft_tokens,
    )


def test_seeded_streams_survive_preemption_and_sigkill_exactly(spec: Spec) -> None:
    """Exact on every run. Whether the survivor drafts for the streams it took over is the
    scheduler's rule's call, made on measured step times and on each stream's own accepted
    drafts (at temperature 1 the tiny model's rarely hold, so a stream's record can rule
    drafts out), so the run is repeated, a few times at most, until it did."""
    prompts = _prompts(8)
    runs = 3
    for _ in range(runs):
        preempted, drafted = _sigkill_mid_run(spec, prompts)
        # all eight on one 48-block pool: some had to be preempted and resumed
        assert preempted > 0
        if drafted > 0:
            return  # and the streams it took over verified drafts
    raise AssertionError(f"the survivor verified no drafts in {runs} runs")


def test_a_draft_model_worker_streams_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--speculative draft with the tiny model as its own draft: every draft holds, and 16
    concurrent greedy streams still equal transformers. The rule tries drafts at a batch
    size only once the next smaller one showed they pay, so batches of 1, 3, 6 and 12
    streams come first, and the 16 streams then draft."""
    s = Suite(tmp_path)
    try:
        registry = s.start_tiny_registry(tiny_model_dir)
        scheduler = s.start_scheduler(registry, "--max-step-stall", "0")
        args = ("--speculative", "draft", "--draft-model", "tiny", "--threads", "1")
        worker = s.start_worker(
            registry, "tiny", *args, "--num-kv-blocks", "96", *TRANSFORMERS_DTYPE
        )
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        gateway = s.start_gateway(registry, scheduler)
        drafted = Spec(s, registry, scheduler, gateway, {"worker": worker})
        tok = reference.tokenizer(tiny_model_dir)
        prompts = _prompts(16)

        def batch(n: int) -> list[list[int]]:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                return list(
                    pool.map(
                        lambda p: drafted.complete(p, 30, temperature=0, ignore_eos=True),
                        prompts[:n],
                    )
                )

        for n in (1, 3, 6, 12):
            batch(n)
        outputs = drafted.drafting(lambda: batch(16))
        for prompt, got in zip(prompts, outputs, strict=True):
            ids = list(tok(prompt, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
            assert got == reference.greedy(tiny_model_dir, ids, 30), prompt
        drafts = drafted.metric(DRAFTED)
        assert drafts > 0 and drafted.metric(ACCEPTED) == drafts  # the model agrees with itself
        fields = {"temperature": 0.9, "seed": 5, "ignore_eos": True}
        on = drafted.drafting(lambda: drafted.complete(prompts[3], 40, **fields))
        assert on == drafted.complete_undrafted(prompts[3], 40, **fields)
    finally:
        s.stop()


def test_canteen_bench_reports_the_acceptance_rate(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The run's drafts and acceptance rate are what the service counted during it. On a
    suite of its own, whose worker drafts with a model (the tiny one itself): a fresh
    scheduler's rule tries drafts on the first request's fourth to sixth decode steps, and a
    draft model proposes on every step it is asked to (n-gram lookup proposes only where the
    random model's text repeats itself, which in CI it once never did)."""
    (tmp_path / "suite").mkdir()
    args: tuple[str, ...] = ("--speculative", "draft", "--draft-model", "tiny")
    args += ("--num-speculative-tokens", "4", "--num-kv-blocks", "48", "--block-size", "8")
    args += ("--threads", "1")
    with _spec_suite(tmp_path / "suite", tiny_model_dir, ("worker",), args) as spec:
        _bench_and_compare(spec, tmp_path)


def _bench_and_compare(spec: Spec, tmp_path: Path) -> None:
    from canteen.tools.bench.server_stats import read_speculation
    from tests.integration.test_bench import canteen

    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"{REPEAT * 3} {i}", "max_tokens": 48}) for i in range(4)]
    prompts.write_text("\n".join(lines) + "\n")
    report = tmp_path / "report.json"
    status = f"{spec.gateway.http_url}/status.json"
    before = asyncio.run(read_speculation(status))
    done = canteen(
        "bench", "--protocol", "http", "--url", spec.gateway.http_url, "--dataset", "jsonl",
        "--path", str(prompts), "--num-requests", "4", "--concurrency", "1", "--no-progress",
        "--json", str(report),
    )  # fmt: skip
    counted = asyncio.run(read_speculation(status)) - before
    assert "Draft tokens / accepted" in done.stdout, done.stdout
    (run,) = json.loads(report.read_text())["runs"]
    figures = run["speculation"]
    assert (figures["draft_tokens"], figures["accepted_tokens"]) == (
        counted.draft_tokens,
        counted.accepted_tokens,
    )
    assert figures["draft_tokens"] > 0  # a repeated text: drafts pay at one stream
    assert figures["acceptance_rate"] == figures["accepted_tokens"] / figures["draft_tokens"]
