"""Tool calling through the whole suite, with the real ``openai`` client and over gRPC.

The tiny model's weights are random and its template knows no tools (the fallback renders
them), so every call below is the grammar's doing: with ``required`` or a named function,
whatever the weights, the answer is a call whose arguments validate against the schema.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from canteen.v1 import common_pb2, inference_pb2
from tests.integration.conftest import TinySuite

# Small schemas: the tiny tokenizer spends a token per character or two, and the tiny suite's
# KV pool holds 768 tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(suite: TinySuite) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{suite.gateway.http_url}/v1", api_key="unused", max_retries=0)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    """Each call names an offered function and its arguments validate; ids are unique."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 150, **kwargs}
    return client.chat.completions.create(**kwargs)


def test_required_gives_one_valid_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = _create(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        reply = _create(client, tool_choice=named, seed=seed, temperature=1.0)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls", choice.message
        assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}
        _check_calls(choice.message.tool_calls, {"get_time"})


def test_streamed_calls_reassemble_in_the_openai_client(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, seed=5
    )
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    _check_calls(calls, set(SCHEMAS))
    expected = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert [(c.function.name, c.function.arguments) for c in calls] == expected


def test_stream_chunks_send_the_name_first_then_the_arguments(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(_create(client, tool_choice=named, seed=2, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert deltas[0][0].index == 0 and deltas[0][0].id.startswith("call_")
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].function.arguments == ""
    assert deltas[1][0].id is None and deltas[1][0].function.name is None
    arguments = "".join(d[0].function.arguments for d in deltas if d[0].index == 0)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)  # the call text is not content


def test_a_tool_result_fed_back_renders_and_gets_an_answer(
    client: openai.OpenAI, suite: TinySuite
) -> None:
    first = _create(client, tool_choice="required", parallel_tool_calls=False, seed=1)
    message = first.choices[0].message
    (call,) = message.tool_calls
    history: list[Any] = [
        *ASK,
        message,  # the client's own message object, as its docs append it
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 21C"}'},
    ]
    reply = _create(client, messages=history, max_tokens=8, seed=1)
    (choice,) = reply.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens
    # the prompt the model saw holds the call and its result (the fallback template)
    ids = httpx.post(
        f"{suite.gateway.http_url}/tokenize",
        json={"model": "tiny", "messages": [*ASK, message.model_dump(), history[-1]]},
    ).json()["tokens"]
    text = httpx.post(
        f"{suite.gateway.http_url}/detokenize", json={"model": "tiny", "tokens": ids}
    ).json()["prompt"]
    assert f'{{"name": "{call.function.name}", "arguments": ' in text
    assert '<tool_response>\n{"forecast": "sunny, 21C"}\n</tool_response>' in text


def test_none_and_auto_answer_in_text(client: openai.OpenAI) -> None:
    for choice_mode in ("none", "auto"):
        reply = _create(client, tool_choice=choice_mode, max_tokens=6, seed=3)
        (choice,) = reply.choices
        # random weights write no <tool_call> block: plain text comes back
        assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
        assert isinstance(choice.message.content, str)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
            "tool_choice: function 'get_news' is not in tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
            "tools[0].function.parameters: json_schema:",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function: expected an object"),
        ({"tool_choice": "always"}, "tool_choice='always': must be"),
    ],
)  # fmt: skip
def test_bad_tools_get_400_naming_the_field(
    suite: TinySuite, extra: dict[str, Any], message: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, **extra}
    reply = httpx.post(f"{suite.gateway.http_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    if "json_schema" in message:
        assert "strin" in reply.json()["error"]["message"]  # the engine's reason


# -- gRPC ------------------------------------------------------------------------------------


def _grpc_request(
    messages: inference_pb2.ChatMessages | None = None, **kwargs: Any
) -> inference_pb2.GenerateRequest:
    tools = [
        inference_pb2.Tool(name=name, parameters_json=json.dumps(schema))
        for name, schema in SCHEMAS.items()
    ]
    ask = inference_pb2.ChatMessage(role="user", content=ASK[0]["content"])
    return inference_pb2.GenerateRequest(
        model="tiny",
        messages=messages or inference_pb2.ChatMessages(messages=[ask]),
        tools=tools,
        max_tokens=150,
        seed=4,
        **kwargs,
    )


def test_grpc_complete_and_generate_return_calls(suite: TinySuite) -> None:
    request = _grpc_request(
        tool_choice=inference_pb2.TOOL_CHOICE_FUNCTION, tool_function="get_weather"
    )
    reply = suite.inference.Complete(request, timeout=60)
    assert reply.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert reply.text == "" and [c.name for c in reply.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(reply.tool_calls[0].arguments_json), WEATHER)
    assert reply.tool_calls[0].id.startswith("call_")
    stream = list(suite.inference.Generate(request, timeout=60))
    assert all(not m.tool_calls for m in stream[:-1])
    last = stream[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert [(c.name, c.arguments_json) for c in last.tool_calls] == [
        (c.name, c.arguments_json) for c in reply.tool_calls
    ]
    # the call fed back as history, answered by a tool message
    history = inference_pb2.ChatMessages(
        messages=[
            *request.messages.messages,
            inference_pb2.ChatMessage(role="assistant", tool_calls=reply.tool_calls),
            inference_pb2.ChatMessage(
                role="tool", tool_call_id=reply.tool_calls[0].id, content="sunny"
            ),
        ]
    )
    again = suite.inference.Complete(
        _grpc_request(messages=history, tool_choice=inference_pb2.TOOL_CHOICE_NONE), timeout=60
    )
    assert again.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert not again.tool_calls


def test_grpc_bad_tools_are_invalid_argument(suite: TinySuite) -> None:
    cases = [
        (
            _grpc_request(tool_choice=inference_pb2.TOOL_CHOICE_FUNCTION, tool_function="nope"),
            "tool_choice: function 'nope' is not in tools",
        ),
        (
            inference_pb2.GenerateRequest(
                model="tiny",
                prompt="hi",
                tools=[inference_pb2.Tool(name="f", parameters_json="{")],
            ),
            "tools[0].parameters: not valid JSON",
        ),
        (
            _grpc_request(
                messages=inference_pb2.ChatMessages(
                    messages=[
                        inference_pb2.ChatMessage(
                            role="assistant",
                            tool_calls=[inference_pb2.ToolCall(name="f", arguments_json="[1]")],
                        )
                    ]
                )
            ),
            "messages[0].tool_calls[0].arguments_json: expected a JSON object",
        ),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as info:
            suite.inference.Complete(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in str(info.value.details())
