"""Requests to gateway processes sharing one port: each on a new connection, so that the
kernel places it, and each process's own count of requests served."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support import reference

PROMPT = "Canteen batches requests"
MAX_TOKENS = 12


def expected_greedy(tiny_model_dir: Path) -> tuple[list[int], str]:
    """transformers' greedy tokens for PROMPT, and their text."""
    tok = reference.tokenizer(tiny_model_dir)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    tokens = reference.greedy(tiny_model_dir, ids, MAX_TOKENS)
    return tokens, tok.decode(tokens, skip_special_tokens=True)  # type: ignore[attr-defined]


def generate_on_new_connection(address: str) -> list[int]:
    """One request on a channel of its own: a new TCP connection the kernel places (a local
    subchannel pool, or gRPC would share one connection between channels)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        )
        return [t for m in stub.Generate(request, timeout=60) for t in m.token_ids]


def complete_over_http(url: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Connection": "close"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return str(json.load(reply)["choices"][0]["text"])


def requests_served(metrics_url: str) -> float:
    """A gateway's own canteen_requests_total, all statuses, from its metrics port."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("canteen_requests_total{")
    )
