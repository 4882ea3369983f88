"""Every request field is honoured or refused, at both edges: unknown keys nested in a body,
no-op fields of the wrong type, and gRPC tool fields the choice would leave unread are 400 /
INVALID_ARGUMENT naming the field's path, in the message and in OpenAI's ``param``."""

from __future__ import annotations

import json
from typing import Any

import httpx2  # the openai client's HTTP library
import openai
import pytest
from pydantic import BaseModel

import gateway.openai_api
from canteen.v1 import inference_pb2
from gateway.errors import InvalidInputError
from gateway.http_errors import as_http_error, error_response
from gateway.openai_api import parse_request
from gateway.openai_messages import _KEYS
from gateway.server import input_from_pb, messages_from_pb, tools_from_pb
from gateway.tools import ROLES

HELLO = [{"role": "user", "content": "hi"}]
FUNCTION = {"name": "f", "parameters": {"type": "object"}}
TOOL = {"type": "function", "function": FUNCTION}
STRICT = {"type": "function", "function": {**FUNCTION, "strict": True}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASSISTANT = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "21"}


def _chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": [*HELLO, *messages], **fields}


def _refusal(body: dict[str, Any], kind: str = "chat") -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        parse_request(kind, body, "r")
    return info.value


# (body, param, the start of the message)
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    # stream_options: include_usage only, and only when streaming (as OpenAI)
    (
        _chat(stream=True, stream_options={"include_usage": True, "chunk_size": 4}),
        "stream_options.chunk_size",
        "stream_options.chunk_size: not supported by this server; remove the field "
        "(supported: include_usage)",
    ),
    (_chat(stream_options={"include_usage": True}), "stream_options", "stream_options: only"),
    (
        _chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
        "stream_options.include_usage: expected a boolean, got str",
    ),
    # messages: keys per role, roles by name
    (
        _chat({"role": "user", "content": "x", "foo": 1}),
        "messages[1].foo",
        "messages[1].foo: not supported on a 'user' message by this server; remove the field "
        "(supported: content, role)",
    ),
    (_chat({"role": "user", "content": "x", "name": "bob"}), "messages[1].name", "messages[1]"),
    (_chat({"role": "system", "content": "x", "name": "a"}), "messages[1].name", "messages[1]"),
    (_chat({**ASSISTANT, "name": "bot"}), "messages[1].name", "messages[1].name: not supported"),
    (_chat({**RESULT, "tool_calls": [CALL]}), "messages[1].tool_calls", "messages[1].tool_calls"),
    (_chat({**HELLO[0], "tool_call_id": "c"}), "messages[1].tool_call_id", "messages[1].tool_"),
    (
        _chat({"role": "wizard", "content": "x"}),
        "messages[1].role",
        "messages[1].role='wizard': must be one of system, user, assistant, tool",
    ),
    (_chat({"role": "developer", "content": "x"}), "messages[1].role", "messages[1].role="),
    (_chat({**RESULT, "name": 5}), "messages[1].name", "messages[1].name: expected a string"),
    (_chat({**ASSISTANT, "refusal": "no"}), "messages[1].refusal", "messages[1].refusal: not"),
    (_chat({"role": "user", "content": 0}), "messages[1].content", "messages[1].content: expec"),
    (
        _chat({"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}),
        "messages[1].content[0].cache",
        "messages[1].content[0].cache: not supported",
    ),
    (
        _chat({**ASSISTANT, "tool_calls": [{**CALL, "index": 0}]}),
        "messages[1].tool_calls[0].index",
        "messages[1].tool_calls[0].index: not supported",
    ),
    (
        _chat({**ASSISTANT, "tool_calls": [{**CALL, "type": "retrieval"}]}),
        "messages[1].tool_calls[0].type",
        "messages[1].tool_calls[0].type: must be 'function'",
    ),
    # tools: extra keys, strict where arguments are not enforced, parallel without tools
    (_chat(tools=[{**TOOL, "x": 1}]), "tools[0].x", "tools[0].x: not supported by this"),
    (
        _chat(tools=[{"type": "function", "function": {**FUNCTION, "examples": []}}]),
        "tools[0].function.examples",
        "tools[0].function.examples: not supported by this server; remove the field "
        "(supported: description, name, parameters, strict)",
    ),
    (
        _chat(tools=[TOOL, STRICT]),
        "tools[1].function.strict",
        "tools[1].function.strict=true: not supported with tool_choice 'auto'",
    ),
    (
        _chat(tools=[STRICT], tool_choice="auto"),
        "tools[0].function.strict",
        "tools[0].function.strict=true",
    ),
    (
        _chat(tools=[{"type": "function", "function": {**FUNCTION, "strict": "yes"}}]),
        "tools[0].function.strict",
        "tools[0].function.strict: expected a boolean",
    ),
    (
        _chat(tools=[{"type": "function", "function": {**FUNCTION, "description": 3}}]),
        "tools[0].function.description",
        "tools[0].function.description: expected a string",
    ),
    (
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f", "x": 1}}),
        "tool_choice.function.x",
        "tool_choice.function.x: not supported",
    ),
    (
        _chat(parallel_tool_calls=False),
        "parallel_tool_calls",
        "parallel_tool_calls: only allowed when tools are given",
    ),
    (_chat(parallel_tool_calls=True, tools=[]), "parallel_tool_calls", "parallel_tool_calls: "),
    # response_format: keys per type, json_schema's own keys
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}),
        "response_format.json_schema.x",
        "response_format.json_schema.x: not supported by this server; remove the field "
        "(supported: name, schema, strict)",
    ),
    (
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "description": "An answer", "schema": SCHEMA},
            }
        ),
        "response_format.json_schema.description",
        "response_format.json_schema.description: not supported",
    ),
    (
        _chat(response_format={"type": "json_object", "json_schema": {"schema": SCHEMA}}),
        "response_format.json_schema",
        "response_format.json_schema: not supported by this server; remove the field "
        "(supported: type)",
    ),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}, "x": 1}),
        "response_format.x",
        "response_format.x: not supported",
    ),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}),
        "response_format.json_schema.strict",
        "response_format.json_schema.strict: expected a bool, got int",
    ),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": {}, "name": 1}}),
        "response_format.json_schema.name",
        "response_format.json_schema.name: expected a str, got int",
    ),
    # no-op fields: the right type and a value that changes nothing
    (_chat(presence_penalty={}), "presence_penalty", "presence_penalty: expected an integer or"),
    (_chat(frequency_penalty=False), "frequency_penalty", "frequency_penalty: expected an"),
    (_chat(frequency_penalty=0.5), "frequency_penalty", "frequency_penalty=0.5: not supported"),
    (_chat(service_tier={}), "service_tier", "service_tier: expected a string, got dict"),
    (_chat(service_tier="flex"), "service_tier", "service_tier='flex': not supported"),
    (_chat(store=0), "store", "store: expected a boolean, got int"),
    (_chat(best_of={}), "best_of", "best_of: expected an integer, got dict"),
    (_chat(logit_bias=[]), "logit_bias", "logit_bias: expected an object, got list"),
    (_chat(logit_bias={"1": 5}), "logit_bias", "logit_bias={'1': 5}: not supported"),
    (_chat(metadata={"a": "b"}), "metadata", "metadata={'a': 'b'}: not supported"),
    (_chat(frobnicate=None), "frobnicate", "frobnicate: not supported by this server"),
    # max_tokens: both names only when they agree, each checked
    (_chat(max_tokens=3, max_completion_tokens=4), "max_tokens", "max_completion_tokens=4 and"),
    (_chat(max_tokens="x", max_completion_tokens=4), "max_tokens", "max_tokens: expected an"),
]


@pytest.mark.parametrize(("body", "param", "message"), REFUSED)
def test_a_field_the_server_would_not_honour_is_refused_by_its_path(
    body: dict[str, Any], param: str, message: str
) -> None:
    refusal = _refusal(body)
    assert str(refusal).startswith(message), str(refusal)
    assert refusal.param == param


def test_completions_refuse_the_same_nested_keys_and_no_op_types() -> None:
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}}
    assert _refusal(body, "completion").param == "stream_options.x"
    assert _refusal({"prompt": "hi", "suffix": {}}, "completion").param == "suffix"
    rf = {"type": "text", "json_schema": {"schema": {}}}
    assert _refusal({"prompt": "hi", "response_format": rf}, "completion").param == (
        "response_format.json_schema"
    )


ACCEPTED: list[dict[str, Any]] = [
    _chat(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, metadata={}, store=False),
    _chat(presence_penalty=None, service_tier="auto", best_of=1, suffix=""),
    _chat(stream=True, stream_options={"include_usage": False}),
    _chat(stream=False, stream_options=None),
    _chat(max_tokens=4, max_completion_tokens=4),
    _chat(tools=[TOOL], parallel_tool_calls=False),
    _chat(tools=[{**TOOL, "function": {**FUNCTION, "strict": False}}]),
    _chat(tool_choice="none"),
    _chat(tool_choice="auto"),
    # the openai client's model_dump() of its own answer, fed back with a tool result
    _chat(
        {
            "content": None,
            "refusal": None,
            "role": "assistant",
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [CALL],
        },
        {**RESULT, "name": "f"},
    ),
    _chat({"role": "assistant", "content": "ok", "tool_calls": None, "refusal": None}),
    _chat({"role": "user", "content": "x", "name": None}),
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_what_is_honoured_or_changes_nothing_is_accepted(body: dict[str, Any]) -> None:
    parse_request("chat", body, "r")


def test_strict_tools_are_accepted_where_the_arguments_are_enforced() -> None:
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named, "none"):
        req = parse_request("chat", _chat(tools=[STRICT], tool_choice=choice), "r")
        tools = req.inputs[0].tools
        assert tools is not None and tools.choice == (choice if choice != named else "function")
        # a forced choice is a grammar over the arguments' schema; none offers nothing
        assert (req.inputs[0].sampling.constraint is not None) == (choice != "none")


def test_json_schema_strict_false_is_enforced_all_the_same() -> None:
    for strict in (True, False, None):
        spec = {"name": "answer", "schema": SCHEMA, "strict": strict}
        body = _chat(response_format={"type": "json_schema", "json_schema": spec})
        constraint = parse_request("chat", body, "r").inputs[0].sampling.constraint
        assert constraint is not None and constraint.kind == "json_schema"
        assert json.loads(constraint.text) == SCHEMA


def test_stream_options_and_messages_are_parsed_into_the_request() -> None:
    body = _chat(ASSISTANT, {**RESULT, "name": "f"}, stream=True)
    req = parse_request("chat", {**body, "stream_options": {"include_usage": True}}, "r")
    assert req.include_usage and req.stream
    messages = req.inputs[0].messages
    assert messages is not None and messages[2] == {**RESULT, "name": "f"}
    assert [c.id for c in messages[1].get("tool_calls", [])] == ["call_1"]
    assert req.inputs[0].max_tokens is None
    req = parse_request("chat", _chat(max_tokens=3, max_completion_tokens=3), "r")
    assert req.inputs[0].max_tokens == 3


def test_every_role_has_its_keys_and_the_docstring_no_longer_says_ignored() -> None:
    assert set(_KEYS) == set(ROLES)
    assert all({"role", "content"} <= keys for keys in _KEYS.values())
    assert "ignored" not in (gateway.openai_api.__doc__ or "")


def test_the_http_error_names_the_field_in_param() -> None:
    response = error_response(as_http_error(_refusal(_chat(presence_penalty={}))))
    assert response.status == 400
    assert response.text is not None
    error = json.loads(response.text)["error"]
    assert error["param"] == "presence_penalty"
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("presence_penalty: expected an integer or a number")
    plain = json.loads(error_response(as_http_error(InvalidInputError("x"))).text or "")
    assert plain["error"]["param"] is None


# -- gRPC --------------------------------------------------------------------------------------


def _grpc(**fields: Any) -> inference_pb2.GenerateRequest:
    ask = inference_pb2.ChatMessage(role="user", content="hi")
    return inference_pb2.GenerateRequest(
        messages=inference_pb2.ChatMessages(messages=[ask]), **fields
    )


GRPC_TOOL = inference_pb2.Tool(name="f")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            dict(tools=[GRPC_TOOL], tool_function="f"),
            "tool_function",
            "tool_function='f': only with tool_choice TOOL_CHOICE_FUNCTION",
        ),
        (
            dict(tools=[GRPC_TOOL], tool_choice=inference_pb2.TOOL_CHOICE_AUTO, tool_function="f"),
            "tool_function",
            "tool_function='f': only with",
        ),
        (dict(tool_function="f"), "tool_function", "tool_function='f': only with"),
        (
            dict(tools=[GRPC_TOOL], tool_choice=9),
            "tool_choice",
            "tool_choice=9: not a known ToolChoice (known: TOOL_CHOICE_NONE, TOOL_CHOICE_AUTO, "
            "TOOL_CHOICE_REQUIRED, TOOL_CHOICE_FUNCTION)",
        ),
        (dict(tool_choice=9), "tool_choice", "tool_choice=9: not a known ToolChoice"),
        (dict(parallel_tool_calls=False), "parallel_tool_calls", "parallel_tool_calls: only"),
    ],
)
def test_grpc_tool_fields_the_choice_would_not_read_are_refused(
    fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        tools_from_pb(_grpc(**fields))
    assert str(info.value).startswith(message), str(info.value)
    assert info.value.param == param


def test_grpc_named_and_unset_choices_still_work() -> None:
    named = tools_from_pb(
        _grpc(tools=[GRPC_TOOL], tool_choice=inference_pb2.TOOL_CHOICE_FUNCTION, tool_function="f")
    )
    assert named is not None and (named.choice, named.function_name) == ("function", "f")
    auto = tools_from_pb(_grpc(tools=[GRPC_TOOL], parallel_tool_calls=False))
    assert auto is not None and auto.choice == "auto" and not auto.parallel
    assert tools_from_pb(_grpc()) is None


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (inference_pb2.ChatMessage(role="user", content="x", tool_call_id="c"), "tool_call_id"),
        (inference_pb2.ChatMessage(role="tool", content="21"), "tool_call_id"),
        (
            inference_pb2.ChatMessage(
                role="user", tool_calls=[inference_pb2.ToolCall(id="c", name="f")]
            ),
            "tool_calls",
        ),
        (inference_pb2.ChatMessage(role="wizard", content="x"), "role"),
    ],
)
def test_grpc_message_fields_must_fit_the_role(
    message: inference_pb2.ChatMessage, param: str
) -> None:
    messages = inference_pb2.ChatMessages(messages=[message])
    with pytest.raises(InvalidInputError) as info:
        messages_from_pb(messages)
    assert info.value.param == f"messages[0].{param}", str(info.value)
    with pytest.raises(InvalidInputError):  # Generate and Complete translate the same way
        input_from_pb(inference_pb2.GenerateRequest(messages=messages), "r")


# -- what the openai client sends --------------------------------------------------------------


def test_the_openai_clients_own_requests_pass_the_checks() -> None:
    """parse() with a pydantic model, and its answer appended to the history as its docs
    show, reach the parser as bodies it accepts (the transport parses and answers)."""
    bodies: list[dict[str, Any]] = []
    message = {"role": "assistant", "content": '{"city": "Paris"}'}
    call = {"role": "assistant", "content": None, "tool_calls": [CALL]}

    def answer(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        bodies.append(body)
        req = parse_request("chat", body, "r")
        reply = call if req.inputs[0].tools is not None else message
        choice = {"index": 0, "finish_reason": "stop", "message": reply, "logprobs": None}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        chat = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}
        return httpx2.Response(200, json={**chat, "choices": [choice], "usage": usage})

    class City(BaseModel):
        city: str

    client = openai.OpenAI(
        base_url="http://canteen/v1",
        api_key="k",
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )
    ask: Any = HELLO  # plain dicts, as applications write them
    tools: Any = [TOOL]
    parsed = client.chat.completions.parse(model="m", messages=ask, response_format=City)
    assert parsed.choices[0].message.parsed == City(city="Paris")
    reply = client.chat.completions.create(
        model="m", messages=ask, tools=tools, tool_choice="required"
    )
    history: list[Any] = [*HELLO, reply.choices[0].message, RESULT]
    client.chat.completions.create(model="m", messages=history, tools=tools)
    dumped: Any = [*HELLO, reply.choices[0].message.model_dump(), RESULT]
    client.chat.completions.create(model="m", messages=dumped)
    assert bodies[0]["response_format"]["json_schema"]["strict"] is True
    assert len(bodies) == 4
