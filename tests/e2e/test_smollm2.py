"""End-to-end checks on the real default model."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from canteen.models import default_model_path
from canteen.v1 import common_pb2, inference_pb2, scheduler_pb2
from tests.e2e.conftest import SmolSuite

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about bread.",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "Say hello in Spanish.",
    "What is a prime number?",
    "Name a planet.",
    "What do bees make?",
    "Translate 'cat' to French.",
    "What is the largest ocean?",
    "Give me a synonym for happy.",
    "What color is the sky?",
    "How many legs has a spider?",
    "What is photosynthesis?",
]


def test_capital_of_france_through_canteen_generate(smol: SmolSuite) -> None:
    canteen = Path(sys.executable).parent / "canteen"
    out = subprocess.run(
        [
            str(canteen),
            "generate",
            "--chat",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--max-tokens",
            "32",
            "--address",
            smol.gateway.address,
            "--insecure",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def _reference(prompts: list[list[int]], max_new: int) -> list[list[int]]:
    path = default_model_path()
    assert path is not None
    model = AutoModelForCausalLM.from_pretrained(  # type: ignore[no-untyped-call]
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:  # one prompt at a time
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
            new = out[0, len(ids) :].tolist()
            outs.append(
                new[:-1] if new and new[-1] == model.generation_config.eos_token_id else new
            )
    return outs


def test_16_concurrent_greedy_streams_equal_transformers_one_at_a_time(smol: SmolSuite) -> None:
    path = default_model_path()
    assert path is not None
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])

    def run(question: str) -> list[int]:
        req = inference_pb2.GenerateRequest(max_tokens=24, temperature=0)
        req.messages.messages.add(role="user", content=question)
        return [t for m in smol.inference.Generate(req, timeout=300) for t in m.token_ids]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        ours = list(pool.map(run, QUESTIONS))
    assert ours == _reference(prompts, 24)


def test_cancelled_stream_frees_its_blocks(smol: SmolSuite) -> None:
    stream = smol.inference.Generate(
        inference_pb2.GenerateRequest(
            prompt="Tell me a long story.", max_tokens=400, ignore_eos=True
        ),
        timeout=300,
    )
    first = next(stream)
    assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    stream.cancel()
    deadline = time.monotonic() + 10
    while True:
        (worker,) = smol.scheduler_stub.GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=10
        ).workers
        if worker.num_free_blocks == worker.num_total_blocks and worker.num_running == 0:
            break
        assert time.monotonic() < deadline, worker
        time.sleep(0.05)
