"""Constrained decoding through the whole suite: JSON schema, regex, choice and grammar.

The tiny model's weights are random, so whatever it emits under a constraint is the grammar
engine's doing: every finished output must parse, match or validate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canteen.v1 import common_pb2, inference_pb2, scheduler_pb2
from tests.integration.conftest import TinySuite
from tests.support import reference
from tests.support.chat import chat, openai_client
from tests.support.streams import Stream, generate

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(suite: TinySuite) -> openai.OpenAI:
    return openai_client(suite.gateway.http_url)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return chat(client, 200, **kwargs)


def test_json_schema_output_validates_and_stops(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = _chat(
            client,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        (choice,) = reply.choices
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    reply = _chat(client, seed=3, max_tokens=400, response_format={"type": "json_object"})
    (choice,) = reply.choices
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice.message.content.startswith("{")


def test_regex_and_choice_outputs_match(client: openai.OpenAI) -> None:
    pattern = r"(yes|no), [0-9]{2,4}!"
    for seed in range(3):
        reply = _chat(client, seed=seed, extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop"
    options = ["red", "green", "blue sky", "日本"]
    seen = set()
    for seed in range(6):
        reply = _chat(client, seed=seed, extra_body={"guided_choice": options})
        assert reply.choices[0].message.content in options
        seen.add(reply.choices[0].message.content)
    assert len(seen) > 1, "sampling under a choice never varied"


def test_grammar_output_parses(client: openai.OpenAI) -> None:
    grammar = (
        'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[1-9][0-9]{0,2}/\n'
    )
    shape = re.compile(r"[0-9()+*]+")
    finished = 0
    for seed in range(4):
        reply = _chat(client, seed=seed, max_tokens=60, extra_body={"guided_grammar": grammar})
        text = reply.choices[0].message.content
        if reply.choices[0].finish_reason == "stop":
            finished += 1
            assert shape.fullmatch(text) and text.count("(") == text.count(")")
            eval(text, {"__builtins__": {}})  # balanced arithmetic: it evaluates
    assert finished, "no expression finished within 60 tokens"


def test_streamed_constrained_output_equals_the_whole(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"seed": 11, "extra_body": {"guided_json": PERSON}}
    whole = _chat(client, **kwargs).choices[0].message.content
    chunks = _chat(client, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_max_tokens_cuts_a_constrained_answer_with_length(client: openai.OpenAI) -> None:
    reply = _chat(client, seed=1, max_tokens=3, extra_body={"guided_json": PERSON})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"guided_json": {"type": "frob"}}, "json_schema: "),
        ({"guided_regex": "a(b"}, "regex: "),
        ({"guided_grammar": "start: foo"}, 'grammar: at 1(8): unknown name: "foo"'),
        ({"guided_choice": []}, "choice has 0 options"),
        ({"guided_choice": ["a", ""]}, "choice: options must not be empty strings"),
        ({"guided_json": "{not json"}, "json_schema is not valid JSON"),
        ({"response_format": {"type": "xml"}}, "response_format.type='xml': must be"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: expected"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex, response_format: give at most one constraint",
        ),
    ],
)
def test_bad_constraints_get_400_with_the_reason(
    client: openai.OpenAI, body: dict[str, Any], reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body=body)
    assert reason in str(info.value), str(info.value)


def test_grpc_constraint_and_invalid_argument(suite: TinySuite) -> None:
    request = inference_pb2.GenerateRequest(
        model="tiny", prompt="Pick one:", max_tokens=30, seed=5, temperature=1.0
    )
    request.constraint.choice.options.extend(["alpha", "beta"])
    reply = suite.inference.Complete(request)
    assert reply.text in ("alpha", "beta")
    assert reply.finish_reason == common_pb2.FINISH_REASON_STOP
    bad = inference_pb2.GenerateRequest(model="tiny", prompt="x", max_tokens=4)
    bad.constraint.json_schema = '{"type": 12}'
    with pytest.raises(grpc.RpcError) as info:
        suite.inference.Complete(bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema: " in str(info.value.details())


def test_constrained_rows_leave_unconstrained_ones_exact(
    suite: TinySuite, client: openai.OpenAI, tiny_model_dir: Path
) -> None:
    """A batch mixing both: the free rows equal transformers token for token."""
    import concurrent.futures

    prompts = [f"Story number {i}:" for i in range(4)]
    tok = reference.tokenizer(tiny_model_dir)

    def free(prompt: str) -> list[int]:
        reply = suite.inference.Complete(
            inference_pb2.GenerateRequest(
                model="tiny", prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True
            )
        )
        return list(reply.token_ids)

    def constrained(seed: int) -> str:
        reply = _chat(client, seed=seed, extra_body={"guided_json": PERSON})
        return str(reply.choices[0].message.content)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        shaped = [pool.submit(constrained, seed) for seed in range(4)]
        frees = [pool.submit(free, p) for p in prompts]
        outputs = [f.result() for f in frees]
        for f in shaped:
            jsonschema.validate(json.loads(f.result()), PERSON)
    for prompt, got in zip(prompts, outputs, strict=True):
        ids = list(tok(prompt, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        assert got == reference.greedy(tiny_model_dir, ids, 24), prompt


def _schemas() -> st.SearchStrategy[Any]:
    leaf: st.SearchStrategy[Any] = st.sampled_from(
        [
            {"type": "integer", "minimum": -50, "maximum": 50},
            {"type": "boolean"},
            {"type": "string", "maxLength": 6},
            {"enum": ["x", "y", 3]},
            {"type": "number", "minimum": 0, "maximum": 1},
            {"type": "null"},
        ]
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.dictionaries(
                st.from_regex(r"[a-z]{1,5}", fullmatch=True), inner, min_size=1, max_size=3
            ).map(
                lambda props: {
                    "type": "object",
                    "properties": props,
                    "required": sorted(props),
                    "additionalProperties": False,
                }
            ),
            inner.map(lambda item: {"type": "array", "items": item, "maxItems": 3}),
        ),
        max_leaves=6,
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas(), seed=st.integers(0, 2**31))
def test_generated_schemas_validate(
    client: openai.OpenAI, schema: dict[str, Any], seed: int
) -> None:
    reply = _chat(client, seed=seed, max_tokens=300, extra_body={"guided_json": schema})
    (choice,) = reply.choices
    text = choice.message.content
    if choice.finish_reason == "length":
        # Every value is bounded in length but a number's fraction: JSON lets a random model
        # write its digits until max_tokens. That is the only way this output may run out.
        assert '"type": "number"' in json.dumps(schema), text
        assert re.search(r"\.\d{40,}$", text), text
        return
    assert choice.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_preempted_constrained_streams_finish_exactly(suite: TinySuite) -> None:
    """More constrained demand than the KV pool holds: preempted streams resume with their
    grammar state rebuilt from the tokens they had, and end as they would alone."""
    constraint = common_pb2.Constraint(regex=r"[a-z]{8}( [a-z]{1,8}){30}\.")
    prompts = [f"Story number {i}:" for i in range(16)]
    before = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    streams = [
        Stream(suite.gateway.address, p, 300, seed=i, constraint=constraint)
        for i, p in enumerate(prompts)
    ]
    for s in streams:
        s.start()
    for s in streams:
        s.join(120)
    after = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert after.workers[0].num_preemptions > before.workers[0].num_preemptions
    for s, prompt in zip(streams, prompts, strict=True):
        assert s.error is None, s.error
        assert s.tokens == generate(suite.gateway.address, prompt, 300, s.seed, constraint)
