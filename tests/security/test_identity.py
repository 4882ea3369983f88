"""Request identity: a client's x-request-id is a label, never a key."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import grpc
import httpx

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.security.conftest import KEY_A, KEY_B, SecureSuite
from tests.support import reference

PROMPTS = [f"tenant {i} asks about the weather in city number {i}" for i in range(8)]


def _grpc_tokens(address: str, prompt: str, key: str, label: str) -> tuple[list[int], str]:
    """Greedy tokens of one stream, and the x-request-id the gateway echoed."""
    with grpc.insecure_channel(address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(
                prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True
            ),
            timeout=120,
            metadata=(("authorization", f"Bearer {key}"), ("x-request-id", label)),
        )
        tokens = [t for msg in call for t in msg.token_ids]
        return tokens, dict(call.initial_metadata())["x-request-id"]


def _http_text(url: str, prompt: str, key: str, label: str) -> tuple[str, str]:
    """The text of one completion over HTTP, and the x-request-id echoed."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    body["ignore_eos"] = True
    headers = {"authorization": f"Bearer {key}", "x-request-id": label}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.headers["x-request-id"]


def test_duplicate_labels_under_load_disturb_no_stream(
    secure: SecureSuite, tiny_model_dir: Path
) -> None:
    tok = reference.tokenizer(tiny_model_dir)
    expected = {
        p: reference.greedy(tiny_model_dir, tok(p, add_special_tokens=False)["input_ids"], 24)  # type: ignore[operator]
        for p in [*PROMPTS, "the victim's own question"]
    }
    gw = secure.shared
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        victim = pool.submit(_grpc_tokens, gw.address, "the victim's own question", KEY_B, "v-1")
        attackers = [pool.submit(_grpc_tokens, gw.address, p, KEY_A, "dup") for p in PROMPTS[:4]]
        http = [pool.submit(_http_text, gw.http_url, p, KEY_A, "dup") for p in PROMPTS[4:]]
        assert victim.result() == (expected["the victim's own question"], "v-1")
        for prompt, future in zip(PROMPTS, attackers, strict=False):
            assert future.result() == (expected[prompt], "dup")  # the label is echoed
        for prompt, done in zip(PROMPTS[4:], http, strict=True):
            text = tok.decode(expected[prompt], skip_special_tokens=True)  # type: ignore[attr-defined]
            assert done.result() == (text, "dup")
    for svc in (secure.scheduler, secure.worker):
        log = svc.log()
        for line in ("sent twice", "sequence refused", "worker lost", "bad plan"):
            assert line not in log, (svc.name, line)
    # Every line about those requests names the label, while the worker keys by its own ids.
    assert '"request_id": "dup"' in secure.worker.log()
