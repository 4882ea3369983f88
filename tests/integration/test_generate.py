"""Generate, Complete and ListModels through the real suite on the tiny model."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

from canteen.v1 import common_pb2, inference_pb2
from tests.integration.conftest import TinySuite
from tests.support import reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "Canteen batches requests",
    "你好，世界",
    "The capital of Italy is Rome and",
    "a",
    "king and queen " * 5,
]


def _stream(
    suite: TinySuite, request: inference_pb2.GenerateRequest
) -> list[inference_pb2.GenerateResponse]:
    return list(suite.inference.Generate(request, timeout=60))


def _ids(messages: list[inference_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_greedy_stream_matches_transformers(suite: TinySuite, tiny_model_dir: Path) -> None:
    tok = reference.tokenizer(tiny_model_dir)
    request = inference_pb2.GenerateRequest(
        prompt=PROMPTS[0], max_tokens=20, temperature=0, ignore_eos=True
    )
    messages = _stream(suite, request)
    prompt_ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert _ids(messages) == reference.greedy(tiny_model_dir, prompt_ids, 20)
    last = messages[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == 20
    assert last.model == "tiny:v1"
    assert all(m.finish_reason == 0 for m in messages[:-1])
    assert len({m.id for m in messages}) == 1 and messages[0].id.startswith("req-")
    text = "".join(m.text for m in messages)
    assert text == tok.decode(_ids(messages), skip_special_tokens=True)  # type: ignore[attr-defined]


def test_concurrent_streams_equal_each_alone(suite: TinySuite, tiny_model_dir: Path) -> None:
    tok = reference.tokenizer(tiny_model_dir)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(16)]

    def run(prompt: str) -> list[int]:
        req = inference_pb2.GenerateRequest(
            prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True
        )
        return _ids(_stream(suite, req))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    for prompt, got in zip(prompts, together, strict=True):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        assert got == reference.greedy(tiny_model_dir, ids, 24), prompt


def test_seeded_sampling_is_reproducible_in_any_batch(suite: TinySuite) -> None:
    def run(seed: int) -> list[int]:
        req = inference_pb2.GenerateRequest(
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0.9,
            top_p=0.95,
            top_k=50,
            seed=seed,
            ignore_eos=True,
        )
        return _ids(_stream(suite, req))

    alone = run(7)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(run, [7, 8, 9, 7, 10, 7]))
    assert crowd[0] == crowd[3] == crowd[5] == alone
    assert len({tuple(c) for c in crowd}) > 1  # other seeds draw other tokens


def test_complete_equals_the_joined_stream(suite: TinySuite) -> None:
    req = inference_pb2.GenerateRequest(
        prompt="The capital of Italy", max_tokens=12, temperature=0, ignore_eos=True
    )
    streamed = _stream(suite, req)
    whole = suite.inference.Complete(req, timeout=60)
    assert list(whole.token_ids) == _ids(streamed)
    assert whole.text == "".join(m.text for m in streamed)
    assert whole.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert whole.usage.completion_tokens == 12


def test_chat_messages_use_the_chat_template(suite: TinySuite, tiny_model_dir: Path) -> None:
    tok = reference.tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "Hello there"}]
    req = inference_pb2.GenerateRequest(max_tokens=8, temperature=0, ignore_eos=True)
    for m in messages:
        req.messages.messages.add(role=m["role"], content=m["content"])
    text = tok.apply_chat_template(  # type: ignore[attr-defined]
        messages,
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    out = _stream(suite, req)
    assert out[-1].usage.prompt_tokens == len(ids)
    assert _ids(out) == reference.greedy(tiny_model_dir, ids, 8)


def test_stop_string_ends_the_text_before_it(suite: TinySuite) -> None:
    base = inference_pb2.GenerateRequest(
        prompt="Once upon a time", max_tokens=30, temperature=0, ignore_eos=True
    )
    full = "".join(m.text for m in _stream(suite, base))
    stop = full[10:13]
    assert stop.strip(), full
    req = inference_pb2.GenerateRequest()
    req.CopyFrom(base)
    req.stop.append(stop)
    out = _stream(suite, req)
    assert "".join(m.text for m in out) == full[: full.index(stop)]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_stop_token_ids_end_the_stream(suite: TinySuite) -> None:
    # Stop on the very token greedy decoding would produce first.
    req = inference_pb2.GenerateRequest(prompt="a", max_tokens=10, temperature=0, ignore_eos=True)
    first = _ids(_stream(suite, req))[0]
    req.stop_token_ids.append(first)
    out = _stream(suite, req)
    assert _ids(out) == []
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert out[-1].usage.completion_tokens == 0


def test_list_models_names_the_default(suite: TinySuite) -> None:
    listing = suite.inference.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
    assert listing.default_model == "tiny"
    models = [(m.name, m.version, m.max_model_len, m.is_ready) for m in listing.models]
    assert models == [("tiny", "v1", 1024, True)]


def test_response_metadata_carries_the_request_id(suite: TinySuite) -> None:
    req = inference_pb2.GenerateRequest(prompt="a", max_tokens=2, temperature=0)
    call = suite.inference.Generate(req, timeout=30, metadata=(("x-request-id", "my-id-1"),))
    messages = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "my-id-1"
    assert messages[0].id == "my-id-1"
    for service in (suite.gateway, suite.scheduler, suite.worker):
        assert '"request_id": "my-id-1"' in service.log(), service.name


def test_a_repeated_prompt_hits_the_prefix_cache_with_identical_tokens(
    suite: TinySuite, tiny_model_dir: Path
) -> None:
    tok = reference.tokenizer(tiny_model_dir)
    prompt = "Canteen batches requests on the fly and streams tokens back one by one. " * 3
    ids = tok(prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    req = inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=16, temperature=0, ignore_eos=True
    )
    first, second = _stream(suite, req), _stream(suite, req)
    assert _ids(first) == _ids(second) == reference.greedy(tiny_model_dir, ids, 16)
    assert second[-1].usage.cached_tokens == (len(ids) - 1) // 8 * 8  # full 8-token blocks
    assert second[-1].usage.prompt_tokens == len(ids)
