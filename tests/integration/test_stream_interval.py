"""A stream interval on the real suite: N tokens per message over gRPC and HTTP, the same
tokens and text for every N, a stop string and a stop token inside a gathered message, a
cancel while tokens are held, and the bound."""

from __future__ import annotations

import math
from typing import Any

import grpc
import openai
import pytest

from canteen.v1 import common_pb2, inference_pb2, scheduler_pb2
from tests.integration.conftest import TinySuite
from tests.integration.test_shared_stream import _num_held
from tests.support.streams import until

PROMPT = "Once upon a time"
MAX_TOKENS = 20


@pytest.fixture
def client(suite: TinySuite) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{suite.gateway.http_url}/v1", api_key="unused", max_retries=0)


def _generate(suite: TinySuite, **fields: Any) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **fields
    )
    return list(suite.inference.Generate(request, timeout=60))


def _check_sizes(sizes: list[int], interval: int) -> None:
    """One message per ``interval`` tokens after the first (the last may have fewer)."""
    assert sum(sizes) == MAX_TOKENS
    assert len(sizes) <= 1 + math.ceil((MAX_TOKENS - 1) / interval), sizes
    assert all(size >= interval for size in sizes[1:-1]), sizes


def test_grpc_gives_the_same_tokens_and_text_for_every_interval(suite: TinySuite) -> None:
    alone = _generate(suite)
    ids = [t for m in alone for t in m.token_ids]
    text = "".join(m.text for m in alone)
    assert len(ids) == MAX_TOKENS and text
    for interval in (1, 3, 4):
        messages = _generate(suite, stream_interval=interval)
        assert [t for m in messages for t in m.token_ids] == ids
        assert "".join(m.text for m in messages) == text
        assert [round(x, 4) for m in messages for x in m.logprobs] == [
            round(x, 4) for m in alone for x in m.logprobs
        ]
        last = messages[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == MAX_TOKENS
        if interval > 1:
            _check_sizes([len(m.token_ids) for m in messages], interval)


def _chat(
    client: openai.OpenAI, interval: int | None, **fields: Any
) -> tuple[str, list[list[str]], Any]:
    extra = {} if interval is None else {"stream_interval": interval}
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **extra},
            **fields,
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join(c.delta.content or "" for c in choices)
    tokens = [[lp.token for lp in c.logprobs.content] for c in choices if c.logprobs]
    finish = next(c.finish_reason for c in choices if c.finish_reason)
    usage = chunks[-1].usage  # cached tokens left out: the prefix cache warms between runs
    return text, tokens, (finish, usage.prompt_tokens, usage.completion_tokens)


def _flat(chunks: list[list[str]]) -> list[str]:
    return [token for chunk in chunks for token in chunk]


def test_http_streams_the_same_text_in_chunks_of_the_interval(client: openai.OpenAI) -> None:
    text, tokens, end = _chat(client, None)
    assert sum(len(t) for t in tokens) == MAX_TOKENS and end[0] == "length"
    for interval in (1, 3, 4):
        got_text, got_tokens, got_end = _chat(client, interval)
        assert (got_text, _flat(got_tokens), got_end) == (text, _flat(tokens), end)
        if interval > 1:
            _check_sizes([len(c) for c in got_tokens if c], interval)


def test_a_stop_string_inside_a_gathered_message_ends_where_it_would_alone(
    client: openai.OpenAI,
) -> None:
    full, _, _ = _chat(client, 1)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    alone = _chat(client, 1, stop=[stop])
    assert alone[0] == full[: full.index(stop)] and alone[2][0] == "stop"
    assert alone[2][2] < MAX_TOKENS
    for interval in (3, 4):
        text, tokens, end = _chat(client, interval, stop=[stop])
        assert (text, _flat(tokens), end) == (alone[0], _flat(alone[1]), alone[2])


def test_a_stop_token_inside_a_gathered_message_ends_where_it_would_alone(
    suite: TinySuite,
) -> None:
    """A stop token (what EOS is) while tokens are held: the stream ends at it with every
    token before it delivered, the same text and finish as with every token alone."""
    ids = [t for m in _generate(suite) for t in m.token_ids]
    at = next(i for i, t in enumerate(ids) if i >= 5 and ids.index(t) == i)
    alone = _generate(suite, stop_token_ids=[ids[at]])
    assert [t for m in alone for t in m.token_ids] == ids[:at]
    for interval in (3, 4):
        messages = _generate(suite, stop_token_ids=[ids[at]], stream_interval=interval)
        assert [t for m in messages for t in m.token_ids] == ids[:at]
        assert "".join(m.text for m in messages) == "".join(m.text for m in alone)
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert messages[-1].usage.completion_tokens == alone[-1].usage.completion_tokens
        assert len(messages) < len(alone)  # the tokens did ride together


def test_a_cancel_while_tokens_are_held_frees_the_request(suite: TinySuite) -> None:
    request = inference_pb2.GenerateRequest(
        prompt=PROMPT, max_tokens=400, temperature=0, ignore_eos=True, stream_interval=64
    )
    call = suite.inference.Generate(request, timeout=60)
    first = next(call)
    assert len(first.token_ids) == 1  # the first token is never held back
    call.cancel()
    until(lambda: _num_held(suite.scheduler_stub) == 0, 10, "the scheduler dropped the request")


def test_an_interval_out_of_bounds_is_refused_naming_the_field_and_limit(
    suite: TinySuite, client: openai.OpenAI
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(suite, stream_interval=65)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = "stream_interval=65: must be in 1..64 (0 or unset: the gateway's default)"
    assert info.value.details() == message
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, 65)
    assert bad.value.status_code == 400 and message in bad.value.message
    assert bad.value.param == "stream_interval"
    # The scheduler holds its own bound.
    direct = scheduler_pb2.ScheduleRequest(
        request_id="bound",
        model="tiny",
        version="v1",
        prompt_token_ids=[5, 6],
        max_tokens=2,
        stream_interval=-1,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(suite.scheduler_stub.Generate(direct, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "stream_interval=-1: must be in 0..64"
