"""A worker's grammar limits through the whole suite: a grammar over them fails its request
alone, with the engine's reason and the worker flag, while a free stream keeps its tokens.
The gateway only converts a constraint to grammar text (the worker's compile is the one
tokenizer-level check), so the worker's refusal is what the client gets: gRPC
INVALID_ARGUMENT, and HTTP 400 streamed or not (the SSE headers wait for it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from canteen.v1 import common_pb2, scheduler_pb2
from tests.integration.conftest import TinySuite, tiny_suite
from tests.support import reference
from tests.support.chat import chat, openai_client
from tests.support.streams import Stream, until
from tests.support.suite import TRANSFORMERS_DTYPE

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    # open, as JSON Schema has it (closed is the default): its lexer needs more fuel
    "additionalProperties": True,
}


REASON = (
    "json_schema: initial lexer configuration (grammar) too big (limit for this grammar: "
    "1000) (the worker's --grammar-lexer-fuel)"
)


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinySuite]:
    # the worker's lexer fuel is far below what any JSON schema needs; the gateway's is not
    worker_args = (*TRANSFORMERS_DTYPE, "--grammar-lexer-fuel", "1000")
    with tiny_suite(tmp_path_factory.mktemp("limited"), tiny_model_dir, 96, worker_args) as s:
        yield s


def test_a_grammar_over_the_workers_limit_fails_alone(
    limited: TinySuite, tiny_model_dir: Path
) -> None:
    prompt = "Story number one:"
    free = Stream(limited.gateway.address, prompt, 48)
    shaped = Stream(
        limited.gateway.address,
        "Who are you?",
        16,
        seed=4,
        constraint=common_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
    )
    free.start()
    shaped.start()
    free.join(120)
    shaped.join(120)
    assert shaped.error is not None and not shaped.tokens
    # the request's own grammar is at fault: the client's error, with the worker's reason
    assert shaped.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert REASON in str(shaped.error.details())
    assert free.error is None
    ids = list(reference.tokenizer(tiny_model_dir)(prompt, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    assert free.tokens == reference.greedy(tiny_model_dir, ids, 48)


def _all_blocks_free(suite: TinySuite) -> bool:
    stats = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    (worker,) = stats.workers
    return bool(worker.num_running == 0 and worker.num_free_blocks == worker.num_total_blocks)


@pytest.mark.parametrize("stream", [False, True])
def test_the_workers_refusal_is_an_http_400_streamed_or_not(
    limited: TinySuite, stream: bool
) -> None:
    client = openai_client(limited.gateway.http_url)
    # a schema no other test sends: neither process has seen it
    schema = {**SCHEMA, "title": f"stream={stream}"}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for attempt in range(2):  # the second meets the worker's cached refusal
        with pytest.raises(openai.BadRequestError) as info:
            reply = chat(client, 16, stream=stream, response_format=response_format)
            if stream:  # before the fix: 200, then the error as an event
                list(reply)
        assert info.value.status_code == 400, attempt
        assert REASON in str(info.value), str(info.value)
    until(lambda: _all_blocks_free(limited), 30, "every block back in the pool")
    # a free request on the same edge still streams
    chunks = list(chat(client, 8, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
