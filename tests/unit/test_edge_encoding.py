"""The edge's per-token encoders give exactly the bytes and messages of the general ones:
a streamed chunk from its template, a shared-stream batch built in place, a stream
interval's gathered events joined once."""

from __future__ import annotations

import json

import pytest

from canteen.codec import batch_to_pb, response_to_pb
from canteen.finish import Finish
from canteen.v1 import scheduler_pb2
from gateway.openai_api import OpenAIRequest
from gateway.openai_responses import ChunkEncoder, chunk_json, sse
from gateway.output import TextDelta, Usage
from gateway.validate import GenerateInput
from scheduler.sequence import SeqEvent, joined
from scheduler.sequence import Usage as SeqUsage

TEXTS = ["plain", ' "quoted" \\ back', "line\nbreak\ttab", "é ✓ 漢字 🙂", "", "\x00\x1f"]


def _request(kind: str) -> OpenAIRequest:
    inputs = [GenerateInput("req-1"), GenerateInput("req-2")]
    return OpenAIRequest(kind, inputs, True, False, False, 0, "tiny", created=1700000000)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_text_chunk_from_its_template_is_the_whole_chunk_encoded(kind: str) -> None:
    req = _request(kind)
    encoder = ChunkEncoder(req)
    for index in (0, 1):
        for text in TEXTS:
            delta = TextDelta(text, [5], "tiny:v1")
            got = encoder.encode(index, delta, None, first=False)
            assert got == sse(chunk_json(req, index, delta, None, False))
            payload = json.loads(got.removeprefix(b"data: "))
            assert payload["choices"][0]["index"] == index
            content = payload["choices"][0]["delta" if kind == "chat" else "text"]
            assert (content["content"] if kind == "chat" else content) == text


def test_first_and_last_chunks_are_encoded_whole() -> None:
    req = _request("chat")
    encoder = ChunkEncoder(req)
    first = TextDelta("Hi", [5], "tiny:v1")
    assert json.loads(encoder.encode(0, first, None, first=True)[6:])["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "Hi",
    }
    last = TextDelta("!", [6], "tiny:v1", Finish.LENGTH, Usage(3, 2, 0))
    assert json.loads(encoder.encode(0, last, None, first=False)[6:])["choices"][0][
        "finish_reason"
    ] == ("length")


def test_a_model_named_like_the_slot_still_gets_its_text() -> None:
    req = _request("chat")
    delta = TextDelta("x", [5], "canteen-text-slot-5f0c")
    got = ChunkEncoder(req).encode(0, delta, None, first=False)
    assert got == sse(chunk_json(req, 0, delta, None, False))


def test_a_batch_built_in_place_equals_one_built_from_separate_responses() -> None:
    top = ((1, -0.25), (2, -1.5))
    entries = [
        (1, SeqEvent("a", (1,), (-0.25,), None, (top,), SeqUsage(3, 1, 0), 0.5), True),
        (2, SeqEvent("b", (7, 8), (-1.0, -2.0), None, (), SeqUsage(4, 2, 1), 0.25), False),
        (3, SeqEvent("c", (9,), (-0.5,), Finish.STOP, (), SeqUsage(5, 6, 2), 0.1), False),
    ]
    separate = scheduler_pb2.ScheduleBatch(
        responses=[response_to_pb(event, first, tag) for tag, event, first in entries]
    )
    batch = batch_to_pb(entries)
    assert batch == separate
    assert batch.responses[0].queue_seconds == 0.5 and batch.responses[1].queue_seconds == 0
    assert not batch.responses[1].HasField("usage")
    assert batch.responses[2].usage.completion_tokens == 6


def test_events_joined_once_keep_every_token_and_end_as_the_last() -> None:
    events = [
        SeqEvent("s", (1,), (-0.1,), queue_seconds=0.5),
        SeqEvent("s", (2, 3), (-0.2, -0.3)),
        SeqEvent("s", (4,), (-0.4,), Finish.LENGTH, usage=SeqUsage(3, 4, 0)),
    ]
    one = joined(events)
    assert (one.token_ids, one.logprobs) == ((1, 2, 3, 4), (-0.1, -0.2, -0.3, -0.4))
    assert (one.finish, one.usage, one.queue_seconds) == (Finish.LENGTH, SeqUsage(3, 4, 0), 0.5)
    assert events[0].then(events[1]).then(events[2]) == one
