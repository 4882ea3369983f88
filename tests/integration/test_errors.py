"""Every bad input gets its status code and a message naming the field and the limit."""

from __future__ import annotations

import grpc
import httpx
import pytest

from canteen.v1 import inference_pb2
from tests.integration.conftest import TinySuite

BAD = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one of prompt or messages"),
    (dict(prompt="hi", model="nope"), grpc.StatusCode.NOT_FOUND, "model 'nope' is not registered"),
    (dict(prompt="hi", model="tiny:v9"), grpc.StatusCode.NOT_FOUND, "'tiny:v9'"),
    (
        dict(prompt="hi", max_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens=0: must be >= 1",
    ),
    (dict(prompt="hi", max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=-3"),
    (
        dict(prompt="hi", max_tokens=5000),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens (5000) exceeds the model's context of 1024 tokens",
    ),
    (
        dict(prompt="hi", temperature=-0.5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature=-0.5: must be in [0, 2]",
    ),
    (
        dict(prompt="hi", top_p=0.0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p=0.0: must be in (0, 1]",
    ),
    (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p=1.5"),
    # Tool fields the choice would leave unread, and an enum number the server does not know
    (
        dict(prompt="hi", tool_function="f"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tool_function='f': only with tool_choice TOOL_CHOICE_FUNCTION",
    ),
    (
        dict(prompt="hi", tool_choice=9),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tool_choice=9: not a known ToolChoice",
    ),
    (
        dict(prompt="hi", top_k=-1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_k=-1: must be in 0..1048576",
    ),
    (
        dict(prompt="hi", stop=["x"] * 17),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop has 17 strings; the limit is 16",
    ),
    (dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop strings must have"),
    (
        dict(prompt="hi", stop_token_ids=[10**6]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop_token_ids: 1000000 is outside the vocabulary",
    ),
    (
        dict(prompt="king " * 1500),
        grpc.StatusCode.INVALID_ARGUMENT,
        "the model's context is 1024 tokens",
    ),
]


@pytest.mark.parametrize(("fields", "code", "message"), BAD)
def test_bad_input_is_refused(
    suite: TinySuite, fields: dict[str, object], code: grpc.StatusCode, message: str
) -> None:
    request = inference_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    for call in (
        lambda: list(suite.inference.Generate(request, timeout=30)),
        lambda: suite.inference.Complete(request, timeout=30),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code
        assert message in info.value.details()


def test_temperature_past_two_is_refused_alike_over_grpc_and_http(suite: TinySuite) -> None:
    message = "temperature=3.0: must be in [0, 2]"
    request = inference_pb2.GenerateRequest(model="tiny", prompt="hi", temperature=3)
    for call in (
        lambda: list(suite.inference.Generate(request, timeout=30)),
        lambda: suite.inference.Complete(request, timeout=30),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == message
    body = {"model": "tiny", "prompt": "hi", "temperature": 3}
    reply = httpx.post(f"{suite.gateway.http_url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == message


def test_bad_chat_role_is_refused(suite: TinySuite) -> None:
    request = inference_pb2.GenerateRequest()
    request.messages.messages.add(role="wizard", content="hi")
    with pytest.raises(grpc.RpcError) as info:
        list(suite.inference.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].role='wizard'" in info.value.details()


def test_empty_messages_are_refused(suite: TinySuite) -> None:
    request = inference_pb2.GenerateRequest(messages=inference_pb2.ChatMessages())
    with pytest.raises(grpc.RpcError) as info:
        list(suite.inference.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages must not be empty" in info.value.details()


def test_request_that_can_never_fit_the_pool_fails_at_once(suite: TinySuite) -> None:
    # 96 blocks of 8 tokens hold 768 tokens; the model's context is 1024.
    request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=900, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        list(suite.inference.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 113 KV blocks; the largest worker has 96" in info.value.details()
