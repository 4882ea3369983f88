"""Two models, two workers each, plus a canary version: every request reaches a worker of the
model it named, the canary splits by weight, and a model without workers is 503 at once."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import reference
from tests.support.stack import worker_stats
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, canteen_models
from tests.support.tiny_model import build_tiny_model

WORKER = ("--num-kv-blocks", "64", "--block-size", "8", "--threads", "1", *TRANSFORMERS_DTYPE)
PROMPT = "Once upon a time"


class Models:
    def __init__(self, suite: Suite, registry: Service, scheduler: Service, gateway: Service):
        self.suite, self.registry, self.scheduler, self.gateway = (
            suite,
            registry,
            scheduler,
            gateway,
        )
        self.client = openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key="x", max_retries=0)

    def steps(self) -> dict[str, int]:
        return {wid: w.num_steps for wid, w in worker_stats(self.scheduler.address).items()}


def _cli(registry: Service, *args: str) -> None:
    done = canteen_models(registry, *args)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def paths(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "tiny:v1": tiny_model_dir,
        "tiny:v2": build_tiny_model(root / "tiny-v2", seed=1),
        "other:v1": build_tiny_model(root / "other", seed=2),
    }


@pytest.fixture(scope="module")
def models(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    s = Suite(tmp_path_factory.mktemp("models-suite"))
    try:
        registry = s.start_registry("--no-register-default", "--default-model", "tiny")
        for ref, path in paths.items():
            name, _, version = ref.partition(":")
            _cli(registry, "add", str(path), "--name", name, "--version", version)
        _cli(registry, "add", str(paths["other:v1"]), "--name", "idle", "--version", "v1")
        _cli(registry, "alias", "tiny", "--to", "v1=50,v2=50")
        scheduler = s.start_scheduler(registry)
        for name, ref in [
            ("t1a", "tiny:v1"),
            ("t1b", "tiny:v1"),
            ("t2", "tiny:v2"),
            ("oa", "other:v1"),
            ("ob", "other:v1"),
        ]:
            s.start_worker(registry, ref, *WORKER, name=name)
        gateway = s.start_gateway(registry, scheduler)
        m = Models(s, registry, scheduler, gateway)
        deadline = time.monotonic() + 30
        while len(m.steps()) < 5:
            assert time.monotonic() < deadline, "the scheduler never saw all five workers"
            time.sleep(0.1)
        yield m
    finally:
        s.stop()


def _greedy(paths: dict[str, Path], ref: str) -> str:
    path = paths[ref]
    tok = reference.tokenizer(path)
    ids = reference.greedy(path, tok(PROMPT, add_special_tokens=False)["input_ids"], 8)  # type: ignore[operator]
    return str(tok.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]


def test_each_model_runs_on_its_own_workers(models: Models, paths: dict[str, Path]) -> None:
    before = models.steps()
    for _ in range(4):
        reply = models.client.completions.create(
            model="other",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.model == "other:v1"
        assert reply.choices[0].text == _greedy(paths, "other:v1")
    after = models.steps()
    moved = {w for w in after if after[w] != before[w]}
    assert moved and moved <= {"oa", "ob"}


def test_a_pinned_version_runs_on_that_version(models: Models, paths: dict[str, Path]) -> None:
    for ref in ("tiny:v1", "tiny:v2"):
        reply = models.client.completions.create(
            model=ref, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.model == ref and reply.choices[0].text == _greedy(paths, ref)


def test_the_two_versions_and_the_other_model_answer_differently(
    models: Models, paths: dict[str, Path]
) -> None:
    """Each model answers with its own weights, so a request routed to the wrong one cannot
    pass the tests above by chance."""
    answers = {}
    for ref in ("tiny:v1", "tiny:v2", "other:v1"):
        reply = models.client.completions.create(
            model=ref, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text == _greedy(paths, ref)
        answers[ref] = reply.choices[0].text
    assert len(set(answers.values())) == 3, answers


def test_the_canary_splits_and_names_the_version_that_served(
    models: Models, paths: dict[str, Path]
) -> None:
    served: Counter[str] = Counter()
    expected = {ref: _greedy(paths, ref) for ref in ("tiny:v1", "tiny:v2")}
    for _ in range(40):
        reply = models.client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        served[reply.model] += 1
        assert reply.choices[0].text == expected[reply.model]  # the named version did the work
    assert set(served) == {"tiny:v1", "tiny:v2"}
    assert 8 <= served["tiny:v2"] <= 32  # 50/50 over 40 draws


def test_a_model_without_workers_is_unavailable_at_once(models: Models) -> None:
    started = time.monotonic()
    reply = httpx.post(
        f"{models.gateway.http_url}/v1/completions",
        json={"model": "idle", "prompt": "a", "max_tokens": 2},
        timeout=30,
    )
    assert reply.status_code == 503
    assert "idle" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 5  # refused, not queued until a timeout
