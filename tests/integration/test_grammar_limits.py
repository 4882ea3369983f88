"""A worker's grammar limits through the whole suite: a grammar over them fails its request
alone, with the engine's reason and the worker flag, while a free stream keeps its tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import common_pb2
from tests.integration.conftest import TinySuite, tiny_suite
from tests.support import reference
from tests.support.streams import Stream
from tests.support.suite import TRANSFORMERS_DTYPE

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    # open, as JSON Schema has it (closed is the default): its lexer needs more fuel
    "additionalProperties": True,
}


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
    assert (
        "json_schema: initial lexer configuration (grammar) too big (limit for this grammar: "
        "1000) (the worker's --grammar-lexer-fuel)"
    ) in str(shaped.error.details())
    assert free.error is None
    ids = list(reference.tokenizer(tiny_model_dir)(prompt, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    assert free.tokens == reference.greedy(tiny_model_dir, ids, 48)
