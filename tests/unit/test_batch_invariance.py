"""A sequence gets the same tokens, and the same logprob bits, however it is served: alone,
or in a random mix of prompt lengths, prefill chunk sizes, prefix-cache hits, preemptions and
batch widths of 1 to 64 rows, in the default number format and in every quantization.

The logprobs are compared bit for bit, not only the tokens: any difference in a row's
reduction order shows up there long before it flips a greedy token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.mixes import Arrival, alone, run_mix
from tests.support.tiny_model import build_tiny_model
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import choose_dtype, load_model
from worker.speculation.speculate import SpeculationConfig

BLOCK = 8
VOCAB = 440  # below the tiny model's vocabulary (455)
FORMATS = [
    ("auto", "none"),
    ("bfloat16", "none"),
    ("float32", "none"),
    ("auto", "int8"),
    ("auto", "int4"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 128: K a multiple of 32 (AMX tiles, whole quantization groups), several blocks
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-wide"), hidden_size=128, intermediate_size=256
    )


_runners: dict[tuple[str, str, str], ModelRunner] = {}


def _runner(
    model_dir: Path, dtype: str, quantization: str, speculative: str = "none"
) -> ModelRunner:
    key = (dtype, quantization, speculative)
    if key not in _runners:
        device = torch.device("cpu")
        chosen, _ = choose_dtype(dtype, device, quantization)
        loaded = load_model(
            str(model_dir), "safetensors", "", device, chosen, False, quantization=quantization
        )
        spec = SpeculationConfig(kind=speculative, num_tokens=4)
        _runners[key] = ModelRunner(
            loaded, RunnerConfig(6000, BLOCK, max_batched_tokens=1024, speculation=spec)
        )
    return _runners[key]


prompts = st.lists(st.integers(3, VOCAB), min_size=1, max_size=70)


@st.composite
def mixes(draw: st.DrawFn) -> list[Arrival]:
    """1 to 64 sequences; some arrive late, some prefill in small chunks, some share the
    first blocks of an earlier one's prompt (a prefix-cache hit), some are preempted."""
    count = draw(st.integers(1, 64))
    out: list[Arrival] = []
    for i in range(count):
        prompt = tuple(draw(prompts))
        shares: bool = bool(out) and draw(st.booleans())
        donor = out[draw(st.integers(0, len(out) - 1))] if shares else None
        cached = 0
        if donor is not None and len(donor.prompt) >= BLOCK:
            cached = BLOCK * draw(st.integers(1, len(donor.prompt) // BLOCK))
            prompt = donor.prompt[:cached] + prompt
        out.append(
            Arrival(
                f"s{i}",
                prompt,
                new=draw(st.integers(1, 12)),
                chunk=draw(st.sampled_from([1, 3, 8, 16, 64, 1024])),
                at_step=draw(st.integers(0, 6)),
                cached_from=donor.seq_id if cached and donor else None,
                num_cached=cached,
                preempt_after=draw(st.sampled_from([0, 0, 0, 2, 5])),
            )
        )
    return out


@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
@settings(
    max_examples=6,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: a mix is slow to run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mix=mixes())
def test_every_sequence_gets_what_it_gets_alone(
    model_dir: Path, dtype: str, quantization: str, mix: list[Arrival]
) -> None:
    runner = _runner(model_dir, dtype, quantization)
    together = run_mix(runner, mix)
    for arrival in mix:
        assert together[arrival.seq_id] == alone(runner, arrival), arrival


def _wide_mix(seed: int) -> list[Arrival]:
    """64 sequences at once, every kind of arrival: a batch of the widest width asked for,
    whatever widths the random mixes above happened to draw."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    for i in range(64):
        prompt = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 60)))
        donor = out[i - 1] if i and i % 5 == 0 and len(out[i - 1].prompt) >= BLOCK else None
        cached = BLOCK if donor else 0
        out.append(
            Arrival(
                f"w{i}",
                (donor.prompt[:cached] if donor else ()) + prompt,
                new=rng.randrange(1, 12),
                chunk=rng.choice([1, 3, 8, 16, 64, 1024]),
                at_step=rng.randrange(0, 4),
                cached_from=donor.seq_id if donor else None,
                num_cached=cached,
                preempt_after=rng.choice([0, 0, 2]),
            )
        )
    return out


@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
def test_sixty_four_sequences_at_once_get_what_they_get_alone(
    model_dir: Path, dtype: str, quantization: str
) -> None:
    runner = _runner(model_dir, dtype, quantization)
    mix = _wide_mix(7)
    together = run_mix(runner, mix)
    for arrival in mix:
        assert together[arrival.seq_id] == alone(runner, arrival), arrival


@pytest.mark.parametrize(("dtype", "quantization"), [("auto", "none"), ("auto", "int4")])
def test_verified_drafts_give_the_tokens_plain_decoding_gives(
    model_dir: Path, dtype: str, quantization: str
) -> None:
    """n-gram drafts verified in the same forward, beside other sequences: the tokens and
    logprobs of plain decoding in the default number format, and drafts were accepted."""
    spec = _runner(model_dir, dtype, quantization, "ngram")
    plain = _runner(model_dir, dtype, quantization)
    looping = tuple([11, 12, 13, 14, 15, 16] * 6)  # prompts that repeat: drafts get found
    mix = [
        Arrival("loop", looping, new=24, chunk=16),
        Arrival("other", tuple(range(40, 90)), new=20, chunk=7, at_step=1),
        Arrival("short", (5, 6, 7, 5, 6, 7, 5, 6), new=16, chunk=1024, at_step=2),
    ]
    accepted = 0
    original = spec.step

    def counting(plan):  # type: ignore[no-untyped-def]
        nonlocal accepted
        result = original(plan)
        accepted += result.num_accepted_tokens
        return result

    spec.step = counting  # type: ignore[method-assign]
    try:
        with_drafts = run_mix(spec, mix, drafts=4)
    finally:
        del spec.step
    assert accepted > 0, "no draft was accepted: the test checked nothing"
    for arrival in mix:
        assert with_drafts[arrival.seq_id] == alone(plain, arrival), arrival.seq_id
