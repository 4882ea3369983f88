"""``canteen up`` restarts a SIGKILLed worker, and the restarted worker answers a repeated
2,000-token prefix from its disk tier: same greedy tokens (float32), cached_tokens says so."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.streams import until
from tests.support.tiny_model import build_tiny_model, build_tokenizer
from tests.support.up import Up

pytestmark = pytest.mark.timeout(900)

BLOCK = 16  # the worker's default --block-size


def _ask(address: str, prompt: str) -> inference_pb2.CompleteResponse:
    request = inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True
    )
    with grpc.insecure_channel(address) as channel:
        reply: inference_pb2.CompleteResponse = inference_pb2_grpc.InferenceStub(channel).Complete(
            request, timeout=120
        )
    return reply


def _text(num_tokens: int, word: str) -> str:
    tok = build_tokenizer()  # the tiny model's
    text = f"{word} "
    while len(tok(text, add_special_tokens=False)["input_ids"]) < num_tokens:
        text += f"{word} {len(text) % 97} "
    return text


def test_a_worker_sigkilled_and_restarted_by_canteen_up_answers_a_2k_prefix_from_disk(
    tmp_path: Path,
) -> None:
    model = build_tiny_model(tmp_path / "models" / "tiny-long", max_len=4096)
    disk = tmp_path / "kv"
    up = Up(
        tmp_path,
        model,
        # 160 blocks of 16: two 2,000-token prompts after it leave none of its blocks
        *("--worker-arg=--num-kv-blocks=160", "--worker-arg=--dtype=float32"),
        *("--worker-arg=--threads=1", "--worker-arg=--max-batched-tokens=512"),
        *("--worker-arg=--kv-host-bytes=0", f"--worker-arg=--kv-disk-dir={disk}"),
    )
    up.start()
    try:
        prefix = _text(2000, "context")
        first = _ask(up.gateway, prefix)
        assert first.usage.cached_tokens == 0 and first.usage.prompt_tokens >= 2000
        for word in ("filler", "other"):  # push the whole prefix out of the pool, to disk
            _ask(up.gateway, _text(2000, word))
        assert len(list(disk.glob("*.kv"))) >= 2000 // BLOCK
        (name,) = up.stats()
        killed = up.kill(name)
        until(
            lambda: up.child(name).restarts == 1 and up.child(name).state == "ready",
            180,
            f"{name} to be restarted",
        )
        assert (up.child(name).restarts, up.child(name).last_exit) == (1, "killed by SIGKILL")
        assert up.child(name).pid != killed
        until(
            lambda: (w := up.stats().get(name)) is not None and w.is_ready,
            60,
            f"the scheduler to use the restarted {name}",
        )
        again = _ask(up.gateway, prefix)
        assert list(again.token_ids) == list(first.token_ids)
        full = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert again.usage.cached_tokens == full
    finally:
        up.stop()
