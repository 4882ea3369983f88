"""The OpenAI-compatible HTTP edge, driven by the real ``openai`` client."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from canteen.v1 import inference_pb2, scheduler_pb2
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite
from tests.support import reference

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(suite: TinySuite) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{suite.gateway.http_url}/v1", api_key="unused", max_retries=0)


def _chat_ids(tiny_model_dir: Path, messages: Sequence[Mapping[str, object]]) -> list[int]:
    tok = reference.tokenizer(tiny_model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    return list(tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def _decode(tiny_model_dir: Path, ids: list[int]) -> str:
    return str(reference.tokenizer(tiny_model_dir).decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]


def test_chat_completion_equals_greedy_transformers(
    client: openai.OpenAI, tiny_model_dir: Path
) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    ids = _chat_ids(tiny_model_dir, HELLO)
    expected = reference.greedy(tiny_model_dir, ids, 12)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "tiny:v1"
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == _decode(tiny_model_dir, expected)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens + reply.usage.prompt_tokens == reply.usage.total_tokens


def test_streamed_chat_joins_to_the_same_answer_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_n_2_give_two_seeded_choices(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=10, seed=7, n=2)
    reply = client.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert reply.object == "text_completion" and [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [c.text for c in again.choices]
    assert reply.usage.completion_tokens == 20
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in reply.choices]


def test_a_stop_string_across_tokens_cuts_the_text(client: openai.OpenAI) -> None:
    base = dict(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0)
    full = client.completions.create(**base).choices[0].text  # type: ignore[call-overload]
    stop = full[10:13]
    assert stop.strip(), full
    reply = client.completions.create(**base, stop=[stop, "never-there"])  # type: ignore[call-overload]
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**base, stop=stop, stream=True)  # type: ignore[call-overload]
        if c.choices
    )
    assert streamed == full[: full.index(stop)]


def test_unicode_streams_without_broken_characters(
    client: openai.OpenAI, tiny_model_dir: Path
) -> None:
    prompt = "你好，世界。🍜🥟"
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    tok = reference.tokenizer(tiny_model_dir)
    ids = reference.greedy(tiny_model_dir, tok(prompt, add_special_tokens=False)["input_ids"], 40)  # type: ignore[operator]
    # The random model may emit stray bytes; streaming must add no broken character of its
    # own: the pieces join to exactly what decoding all tokens at once gives.
    assert "".join(pieces) == _decode(tiny_model_dir, ids)
    assert sum(p.count("\ufffd") for p in pieces) == _decode(tiny_model_dir, ids).count("\ufffd")
    assert len(pieces) > 1


def test_logprobs_and_top_logprobs_match_the_greedy_choice(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= 0


def test_models_lists_the_registry(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_tokenize_and_detokenize_round_trip(suite: TinySuite, tiny_model_dir: Path) -> None:
    base = suite.gateway.http_url
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "Once upon a time"}).json()
    tok = reference.tokenizer(tiny_model_dir)
    assert ids["tokens"] == tok("Once upon a time", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    chat = httpx.post(f"{base}/tokenize", json={"messages": HELLO}).json()
    assert chat["tokens"] == _chat_ids(tiny_model_dir, HELLO) and chat["model"] == "tiny:v1"
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text["prompt"] == "Once upon a time"
    grpc_ids = suite.inference.Tokenize(inference_pb2.TokenizeRequest(prompt="Once upon a time"))
    assert list(grpc_ids.token_ids) == ids["tokens"]
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "tiny", "prompt": "a", "temperature": 3}, 400, "temperature=3.0: must be in"),
        ({"model": "tiny", "prompt": "a", "n": 9}, 400, "n=9: must be in 1..4"),
        ({"model": "tiny", "prompt": "a", "max_tokens": "x"}, 400, "max_tokens: expected an"),
        ({"model": "tiny", "prompt": "a", "max_tokens": 5000}, 400, "exceeds the model's context"),
        ({"model": "nope", "prompt": "a"}, 404, "model 'nope' is not registered"),
        ({"model": "tiny"}, 400, "prompt: expected a string"),
        # Fields the server does not honour are refused by name, never dropped silently.
        ({"model": "tiny", "prompt": "a", "frobnicate": 1}, 400, "frobnicate: not supported"),
        ({"model": "tiny", "prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty=0.5"),
        ({"model": "tiny", "prompt": "a", "messages": []}, 400, "messages: not supported"),
    ],
)
def test_bad_requests_get_openai_errors(
    suite: TinySuite, body: dict[str, object], status: int, message: str
) -> None:
    reply = httpx.post(f"{suite.gateway.http_url}/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]
    assert reply.headers["x-request-id"].startswith("req-")


def test_unsupported_features_are_refused_not_ignored(client: openai.OpenAI) -> None:
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="logit_bias="):
        client.chat.completions.create(model="tiny", messages=chat, logit_bias={"1": 5})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools: not supported"):
        client.completions.create(model="tiny", prompt="Hi", extra_body={"tools": [tool]})
    # What clients send by default, at values that change nothing, still works.
    reply = client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=2, presence_penalty=0, frequency_penalty=0
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_nested_keys_the_server_does_not_read_are_refused_with_their_path(
    client: openai.OpenAI,
) -> None:
    named: list[Any] = [{"role": "user", "content": "Hi", "name": "bob"}]
    with pytest.raises(openai.BadRequestError, match="not supported on a 'user' message") as info:
        client.chat.completions.create(model="tiny", messages=named, max_tokens=2)
    assert info.value.param == "messages[0].name"
    hello: Any = HELLO
    options: Any = {"include_usage": True, "chunk_size": 4}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=hello, max_tokens=2, stream=True, stream_options=options
        )
    assert info.value.param == "stream_options.chunk_size"


def test_the_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not registered"):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError, match=r"top_p=0.0: must be in \(0, 1\]"):
        client.completions.create(model="tiny", prompt="a", top_p=0)


def test_a_body_over_the_limit_is_refused(suite: TinySuite) -> None:
    body = json.dumps({"model": "tiny", "prompt": "a" * (5 * 1024 * 1024)})
    reply = httpx.post(
        f"{suite.gateway.http_url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status_code in (400, 413)
    assert "too large" in reply.text.lower() or "exceeds" in reply.text.lower()


def test_a_client_leaving_mid_stream_cancels_upstream(suite: TinySuite) -> None:
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 600, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{suite.gateway.http_url}/v1/completions", json=body) as reply:
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 10
    while True:
        stats = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        (worker,) = stats.workers
        if worker.num_running == 0 and worker.num_free_blocks == NUM_KV_BLOCKS:
            break
        assert time.monotonic() < deadline, "the stream kept running after the client left"
        time.sleep(0.05)
