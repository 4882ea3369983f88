"""gRPC translation for canteen.v1.Inference."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from canteen.auth import ApiKeys, AuthenticationError, Principal
from canteen.codec import sampling_from_request
from canteen.finish import finish_to_pb
from canteen.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from gateway.errors import InvalidInputError, clip, status_of
from gateway.limits import RateLimitedError
from gateway.output import TextDelta
from gateway.service import GenerateInput, InferenceService, choose_request_id
from gateway.tools import (
    ChatMessage,
    Function,
    ToolCall,
    ToolRequest,
    check_message,
    check_tools,
    with_tool_constraint,
)

_CHOICES = {
    inference_pb2.TOOL_CHOICE_NONE: "none",
    inference_pb2.TOOL_CHOICE_AUTO: "auto",
    inference_pb2.TOOL_CHOICE_REQUIRED: "required",
    inference_pb2.TOOL_CHOICE_FUNCTION: "function",
}


def _call_from_pb(call: inference_pb2.ToolCall, where: str) -> ToolCall:
    arguments = _json_object(call.arguments_json, f"{where}.arguments_json", {})
    return ToolCall(call.name, json.dumps(arguments, ensure_ascii=False), id=call.id)


def messages_from_pb(messages: inference_pb2.ChatMessages) -> list[ChatMessage]:
    """Chat messages with their calls (arguments checked to be JSON objects); calls only on
    an assistant's, a call id only (and always) on a tool's."""
    out: list[ChatMessage] = []
    for i, m in enumerate(messages.messages):
        message: ChatMessage = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                _call_from_pb(c, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(m.tool_calls)
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(check_message(i, message))
    return out


def _json_object(text: str, name: str, empty: dict[str, Any]) -> dict[str, Any]:
    """``text`` as a JSON object (``empty`` when it is empty); else InvalidInputError."""
    try:
        value = json.loads(text) if text else empty
    except ValueError as exc:
        raise InvalidInputError(f"{name}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"{name}: expected a JSON object")
    return value


def _check_choice(msg: inference_pb2.GenerateRequest) -> None:
    """Refuses what the choice would otherwise leave unread: an enum number this server does
    not know, ``tool_function`` without TOOL_CHOICE_FUNCTION, ``parallel_tool_calls``
    without tools."""
    if msg.tool_choice not in _CHOICES and msg.tool_choice != inference_pb2.TOOL_CHOICE_UNSPECIFIED:
        known = ", ".join(inference_pb2.ToolChoice.Name(n) for n in _CHOICES)
        raise InvalidInputError(
            f"tool_choice={msg.tool_choice}: not a known ToolChoice (known: {known})",
            param="tool_choice",
        )
    if msg.tool_function and msg.tool_choice != inference_pb2.TOOL_CHOICE_FUNCTION:
        raise InvalidInputError(
            f"tool_function={clip(msg.tool_function)}: only with tool_choice "
            "TOOL_CHOICE_FUNCTION (it names the function that must be called)",
            param="tool_function",
        )
    if msg.HasField("parallel_tool_calls") and not msg.tools:
        raise InvalidInputError(
            "parallel_tool_calls: only allowed when tools are given", param="parallel_tool_calls"
        )


def tools_from_pb(msg: inference_pb2.GenerateRequest) -> ToolRequest | None:
    """The request's tools; None when it has none and forces nothing."""
    _check_choice(msg)
    if not msg.tools and msg.tool_choice == inference_pb2.TOOL_CHOICE_UNSPECIFIED:
        return None
    functions = tuple(
        Function(
            t.name,
            t.description,
            _json_object(
                t.parameters_json, f"tools[{i}].parameters", {"type": "object", "properties": {}}
            ),
        )
        for i, t in enumerate(msg.tools)
    )
    choice = _CHOICES.get(msg.tool_choice, "auto" if functions else "none")
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else True
    return check_tools(ToolRequest(functions, choice, msg.tool_function, parallel))


def _calls_to_pb(calls: list[ToolCall]) -> list[inference_pb2.ToolCall]:
    return [inference_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments) for c in calls]


def input_from_pb(
    msg: inference_pb2.GenerateRequest, request_id: str, traceparent: str = ""
) -> GenerateInput:
    which = msg.WhichOneof("input")
    tools = tools_from_pb(msg)
    return GenerateInput(
        request_id=request_id,
        traceparent=traceparent,
        model=msg.model,
        prompt=msg.prompt if which == "prompt" else None,
        messages=messages_from_pb(msg.messages) if which == "messages" else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        sampling=with_tool_constraint(sampling_from_request(msg), tools),
        tools=tools,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        priority=msg.priority,
        disable_speculation=msg.disable_speculation,
        stream_interval=msg.stream_interval,
    )


async def _abort_known(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status of a known error; re-raises anything else."""
    code = status_of(exc)
    if code is None:
        raise exc
    await context.abort(code, str(exc))


async def _abort_limited(context: grpc.aio.ServicerContext, exc: RateLimitedError) -> None:
    context.set_trailing_metadata((("retry-after", f"{exc.retry_after:.3f}"),))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


def _usage_to_pb(delta: TextDelta) -> common_pb2.Usage | None:
    if delta.usage is None:
        return None
    u = delta.usage
    return common_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
    )


def response_of(request_id: str, delta: TextDelta) -> inference_pb2.GenerateResponse:
    """One Generate message; only the fields the delta has are set (every field set costs
    on the per-token path)."""
    response = inference_pb2.GenerateResponse(
        id=request_id,
        text=delta.text,
        token_ids=delta.token_ids,
        model=delta.model,
        logprobs=delta.logprobs,
    )
    if delta.finish_reason is not None:
        response.finish_reason = finish_to_pb(delta.finish_reason)
    if (usage := _usage_to_pb(delta)) is not None:
        response.usage.CopyFrom(usage)
    if delta.top_logprobs:
        response.top_logprobs.extend(
            common_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[p for _, p in top])
            for top in delta.top_logprobs
        )
    if delta.tool_calls:
        response.tool_calls.extend(_calls_to_pb(delta.tool_calls))
    return response


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, service: InferenceService, keys: ApiKeys) -> None:
        self._service = service
        self._keys = keys

    async def _begin(self, context: grpc.aio.ServicerContext) -> Principal:
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        try:
            principal = self._keys.authenticate(str(metadata.get("authorization", "")) or None)
        except AuthenticationError as exc:
            self._service.metrics.refused(grpc.StatusCode.UNAUTHENTICATED.name)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        request_id = choose_request_id(str(metadata.get("x-request-id", "")))
        structlog.contextvars.bind_contextvars(request_id=request_id)
        await context.send_initial_metadata((("x-request-id", request_id),))
        return principal

    async def _open(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[str, AsyncIterator[TextDelta]]:
        """The request admitted: its id, and the service's stream of its deltas (iterated
        by the handler itself: every generator a message passes through costs on the
        per-token path)."""
        principal = await self._begin(context)
        request_id = str(structlog.contextvars.get_contextvars()["request_id"])
        metadata = dict(context.invocation_metadata() or ())
        inp = input_from_pb(request, request_id, str(metadata.get("traceparent", "")))
        admitted = await self._service.admit(inp, principal)
        return request_id, self._service.stream(admitted, context.time_remaining())

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            request_id, deltas = await self._open(request, context)
            async for delta in deltas:
                yield response_of(request_id, delta)
        except RateLimitedError as exc:
            await _abort_limited(context, exc)
        except Exception as exc:
            await _abort_known(context, exc)

    async def Complete(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CompleteResponse:
        response = inference_pb2.CompleteResponse()
        texts: list[str] = []
        try:
            response.id, deltas = await self._open(request, context)
            async for delta in deltas:
                texts.append(delta.text)
                response.token_ids.extend(delta.token_ids)
                response.model = delta.model
                response.tool_calls.extend(_calls_to_pb(delta.tool_calls))
                if delta.finish_reason is not None:
                    response.finish_reason = finish_to_pb(delta.finish_reason)
                    usage = _usage_to_pb(delta)
                    if usage is not None:
                        response.usage.CopyFrom(usage)
        except RateLimitedError as exc:
            await _abort_limited(context, exc)
        except Exception as exc:
            await _abort_known(context, exc)
        response.text = "".join(texts)
        return response

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        principal = await self._begin(context)
        which = request.WhichOneof("input")
        try:
            model, ids = await self._service.tokens.tokenize(
                request.model,
                request.prompt if which == "prompt" else None,
                messages_from_pb(request.messages) if which == "messages" else None,
                principal,
            )
        except RateLimitedError as exc:
            await _abort_limited(context, exc)
        except Exception as exc:
            await _abort_known(context, exc)
        return inference_pb2.TokenizeResponse(model=model, token_ids=ids)

    async def Detokenize(
        self, request: inference_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.DetokenizeResponse:
        principal = await self._begin(context)
        try:
            model, text = await self._service.tokens.detokenize(
                request.model, list(request.token_ids), principal
            )
        except RateLimitedError as exc:
            await _abort_limited(context, exc)
        except Exception as exc:
            await _abort_known(context, exc)
        return inference_pb2.DetokenizeResponse(model=model, text=text)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        principal = await self._begin(context)
        catalog = self._service.catalog
        ready = await self._service.ready_models()
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    name=m.name,
                    version=m.version,
                    max_model_len=m.max_model_len,
                    is_ready=m.served.name in ready,
                    parent=m.base.name if m.base is not None else "",
                )
                for m in catalog.models()
                if principal.allows(m.name)
            ],
            default_model=catalog.default_model if principal.allows(catalog.default_model) else "",
        )
