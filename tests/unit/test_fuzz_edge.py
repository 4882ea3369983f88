"""The edge fuzz targets (tests/fuzz/fuzz_edge.py): regressions in-process, and a bounded
atheris run of each target in a subprocess (atheris is a dev dependency: missing, it fails)."""

from __future__ import annotations

import importlib.util
import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from canteen.plan import Sampling
from gateway.errors import InvalidInputError
from gateway.openai_api import parse_request
from gateway.service import GenerateInput
from gateway.tokenizers import TemplateError
from tests.fuzz import fuzz_edge
from worker.engine.sampler import sample

FUZZ = Path(fuzz_edge.__file__)
HAS_ATHERIS = importlib.util.find_spec("atheris") is not None
RUNS = {"parse_request": 20000, "check_shape": 20000, "tokenizer": 4000}

HELLO = [{"role": "user", "content": "hi"}]

# (kind, body, the start of the InvalidInputError message; None: accepted)
REGRESSIONS: list[tuple[str, object, str | None]] = [
    # float() of an integer past the float range raised OverflowError: HTTP 500
    ("completion", {"prompt": "hi", "temperature": 10**400}, "temperature: the number is"),
    ("completion", {"prompt": "hi", "top_p": -(10**400)}, "top_p: the number is too large"),
    # seeds outside uint64 raised ValueError building SamplingParams upstream: HTTP 500
    ("completion", {"prompt": "hi", "seed": 2**64}, "seed=18446744073709551616: must be in"),
    ("completion", {"prompt": "hi", "seed": -(2**63) - 1}, "seed=-9223372036854775809"),
    ("completion", {"prompt": "hi", "seed": -1}, None),  # an int64 seed, sent modulo 2**64
    ("chat", {"messages": HELLO, "seed": 2**64 - 1, "n": 4}, None),  # seed + i wraps
    # lone surrogates (JSON "\ud800") made the Rust tokenizer raise TypeError: HTTP 500
    ("completion", {"prompt": "hi \ud800"}, "prompt: not valid Unicode"),
    ("completion", {"prompt": ["\udfff"]}, "prompt: not valid Unicode"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content: not"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
        "messages[0].content: not valid Unicode",
    ),
    ("completion", {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop[1]: not valid Unicode"),
    ("completion", {"prompt": "hi", "stop": "\ud800"}, "stop: not valid Unicode"),
    # str() of any role or text part: a deeply nested list could hit the recursion limit
    ("chat", {"messages": [{"role": [[["user"]]], "content": "x"}]}, "messages[0].role: expected"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role: expected a string"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text: expected a string",
    ),
]


@pytest.mark.parametrize(("kind", "body", "message"), REGRESSIONS)
def test_parse_request_regressions(kind: str, body: object, message: str | None) -> None:
    fuzz_edge.check_parse_request(kind, body)  # no exception but InvalidInputError
    if message is None:
        req = parse_request(kind, body, "req-1")
        assert all(0 <= i.sampling.seed < 2**64 for i in req.inputs)
        return
    with pytest.raises(InvalidInputError) as info:
        parse_request(kind, body, "req-1")
    assert str(info.value).startswith(message), str(info.value)


def test_seeds_of_n_choices_wrap_around_uint64() -> None:
    req = parse_request("chat", {"messages": HELLO, "seed": 2**64 - 2, "n": 3}, "r")
    assert [i.sampling.seed for i in req.inputs] == [2**64 - 2, 2**64 - 1, 0]
    inp = parse_request("chat", {"messages": HELLO, "seed": -1}, "r").inputs[0]
    assert inp.sampling.seed == 2**64 - 1


def test_tokenizer_refuses_lone_surrogates_naming_the_field() -> None:
    tok = fuzz_edge.tokenizer()
    fuzz_edge.check_tokenizer([{"role": "user", "content": "\ud800"}], "\udc00", [0, 2**31 - 1])
    with pytest.raises(TemplateError, match=r"^messages\[1\]\.content: not valid Unicode"):
        tok.render_chat([{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}])
    with pytest.raises(TemplateError, match="not valid Unicode"):
        tok.encode("x\udfff")


def test_check_shape_regressions() -> None:
    for inp in (
        GenerateInput("r", prompt="hi", sampling=Sampling(temperature=float("nan"))),
        GenerateInput("r", prompt="hi", sampling=Sampling(top_p=float("inf"))),
        GenerateInput("r", prompt="hi", sampling=Sampling(top_logprobs=2**31 - 1)),
        GenerateInput("r", messages=[{"role": "user", "content": "x"}] * 257),
        GenerateInput("r", prompt="hi", stop=["x" * 257]),
        GenerateInput(
            "r", prompt="hi", max_tokens=2**200, sampling=Sampling(seed=2**64 - 1, top_k=2**31 - 1)
        ),
    ):
        fuzz_edge.check_shape(inp)


def test_a_temperature_check_shape_accepts_never_breaks_the_sampler() -> None:
    logits = torch.tensor([[60.0, -40.0, 3.0, 12.0]])  # the tiny model's logits are this big
    for value in (1e-40, 1e-38, 1e-20, 1e-6):
        temperature = float(np.float32(value))  # what the proto's float field carries
        try:
            fuzz_edge.SERVICE.check_shape(
                GenerateInput("r", prompt="hi", sampling=Sampling(temperature=temperature))
            )
        except InvalidInputError:
            continue
        sample(logits, [Sampling(temperature=temperature, seed=1)], [0])


@pytest.mark.parametrize("target", list(RUNS))
def test_fuzz_target_finds_nothing(target: str, tmp_path: Path) -> None:
    # atheris is a dev dependency: missing, it is a broken install, never a silent skip.
    assert HAS_ATHERIS, "atheris is not installed: pip install -e '.[dev]'"
    # libFuzzer checks its peak RSS (getrusage), and Linux hands a child the peak of the
    # process it was spawned from: this test process, which may have loaded a model. So the
    # limit is libFuzzer's default 2 GiB of growth on top of that peak.
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ),
            f"--target={target}",
            f"-atheris_runs={RUNS[target]}",
            "-max_total_time=30",
            "-seed=1",
            f"-rss_limit_mb={peak_mb + 2048}",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert not list(tmp_path.glob("crash-*"))
    # Every run was made: -max_total_time ends a slow run early, and exits 0 all the same.
    done = re.findall(r"^Done (\d+) ", proc.stderr, re.MULTILINE)
    assert done == [str(RUNS[target])], f"runs: {done}, not {RUNS[target]}\n{proc.stderr[-2000:]}"
