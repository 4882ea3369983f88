"""The OpenAI-compatible HTTP edge (aiohttp), in front of the same path as the gRPC API.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize              POST /detokenize       GET /healthz

Streams are server-sent events ending in ``data: [DONE]``. Errors are OpenAI's error
object with the HTTP status mapped from the gRPC code. A client that goes away mid-stream
cancels its request upstream: the handler is cancelled, and so is the scheduler call.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from canteen.auth import ApiKeys, AuthenticationError
from canteen.logging import get_logger
from canteen.metrics import metrics_handler
from gateway.errors import InvalidInputError, UpstreamError, refuse_unknown
from gateway.http_errors import HttpError, as_http_error, error_body, error_response
from gateway.openai_api import OpenAIRequest, parse_request
from gateway.openai_messages import check_text, parse_messages
from gateway.openai_responses import (
    ChoiceResult,
    ChunkEncoder,
    TokenLogprobs,
    logprobs_json,
    response_json,
    sse,
    usage_chunk_json,
    usage_json,
)
from gateway.output import TextDelta, Usage, request_usage
from gateway.service import Admitted, InferenceService, choose_request_id
from gateway.status import status_routes

log = get_logger(__name__)
T = TypeVar("T")
# Served without an API key: probes, Prometheus and the status page.
_OPEN_PATHS = frozenset({"/healthz", "/metrics", "/status", "/status.json"})
# What the service looks like inside (batches, request labels, metrics): an admin key's,
# whenever API keys are configured. Browsers may send it as Basic auth (any user name).
_ADMIN_PATHS = frozenset({"/metrics", "/status", "/status.json"})
# What /tokenize and /detokenize read; any other field is refused, naming it.
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _bearer(authorization: str | None) -> str | None:
    """``Basic base64(user:KEY)`` (a browser's login box) as ``Bearer KEY``."""
    if authorization and authorization[:6].lower() == "basic ":
        try:
            _, _, key = base64.b64decode(authorization[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return authorization
        return f"Bearer {key}"
    return authorization


class HttpEdge:
    def __init__(
        self,
        service: InferenceService,
        keys: ApiKeys,
        max_body_bytes: int,
        metrics_registry: CollectorRegistry,
        admin_keys: ApiKeys | None = None,
        suite_state: str = "",
    ) -> None:
        self.service = service
        self.keys = keys
        self.admin_keys = admin_keys or ApiKeys([])
        self.max_body_bytes = max_body_bytes
        self.is_draining = False
        self.in_flight = 0
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._middleware])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/healthz", self.healthz),
                web.get("/metrics", metrics_handler(metrics_registry)),
                *status_routes(service.scheduler, suite_state),
            ]
        )

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        request_id = choose_request_id(request.headers.get("x-request-id", ""))
        request["request_id"] = request_id
        structlog.contextvars.bind_contextvars(request_id=request_id)
        self.in_flight += 1
        try:
            if request.path in _ADMIN_PATHS and self.keys.is_enabled:
                self._require_admin(request)
            if request.path not in _OPEN_PATHS:
                if self.is_draining:
                    raise HttpError(grpc.StatusCode.UNAVAILABLE, "the gateway is draining")
                try:
                    request["principal"] = self.keys.authenticate(
                        request.headers.get("Authorization")
                    )
                except AuthenticationError:
                    self.service.metrics.refused(grpc.StatusCode.UNAUTHENTICATED.name)
                    raise
            response = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            limit = self.max_body_bytes
            _, body = error_body(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request body exceeds the limit of {limit} bytes (--max-body-bytes)",
            )
            response = web.json_response(body, status=413)
        except Exception as exc:
            response = error_response(as_http_error(exc))  # re-raises what it does not know
        finally:
            self.in_flight -= 1
            structlog.contextvars.unbind_contextvars("request_id")
        if not response.prepared:
            response.headers["x-request-id"] = request_id
        return response

    def _require_admin(self, request: web.Request) -> None:
        if not self.admin_keys.is_enabled:
            raise HttpError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{request.path} needs an admin key: start the gateway with --admin-keys-file",
            )
        try:
            self.admin_keys.authenticate(_bearer(request.headers.get("Authorization")))
        except AuthenticationError as exc:
            raise web.HTTPUnauthorized(
                text=json.dumps(
                    error_body(grpc.StatusCode.UNAUTHENTICATED, f"admin key: {exc}")[1]
                ),
                content_type="application/json",
                headers={"WWW-Authenticate": 'Basic realm="canteen admin"'},
            ) from None

    async def _body(self, request: web.Request) -> object:
        raw = await request.read()  # HTTPRequestEntityTooLarge past --max-body-bytes
        charset = request.charset or "utf-8"
        try:
            text = raw.decode(charset)
        except LookupError:
            raise InvalidInputError(
                f"the request body's charset {charset[:64]!r} is not a known text encoding"
            ) from None
        except ValueError as exc:  # UnicodeDecodeError, and codecs' own UnicodeErrors
            raise InvalidInputError(f"the request body is not valid {charset[:64]}: {exc}") from exc
        try:
            return json.loads(text)
        except RecursionError:
            raise InvalidInputError(
                "the request body is not valid JSON: its arrays or objects nest too deeply"
            ) from None
        except ValueError as exc:  # JSONDecodeError, or an integer past the digit limit
            raise InvalidInputError(f"the request body is not valid JSON: {exc}") from exc

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        req = parse_request(kind, await self._body(request), request["request_id"])
        traceparent = request.headers.get("traceparent", "")
        if traceparent:
            inputs = [dataclasses.replace(i, traceparent=traceparent) for i in req.inputs]
            req = dataclasses.replace(req, inputs=inputs)
        if req.user:
            log.info("request user", user=user_label(req.user))
        # Every check (and the rate limit) passes before any byte is sent, so errors get a
        # real status code; the choices share one preparation.
        admitted = await self.service.admission.admit_all(req.inputs, request["principal"])
        if req.stream:
            return await self._stream(request, req, admitted)
        results = await asyncio.gather(*(self._collect(req, a) for a in admitted))
        return web.json_response(response_json(req, results))

    async def _collect(self, req: OpenAIRequest, admitted: Admitted) -> ChoiceResult:
        result = ChoiceResult()
        texts: list[str] = []
        async for delta in self.service.stream(admitted, None):
            texts.append(delta.text)
            part = logprobs_json(req, self._token_logprobs(req, delta))
            if part is not None:
                result.logprobs.append(part)
            result.model = delta.model
            result.tool_calls.extend(delta.tool_calls)
            if delta.finish_reason is not None:
                result.finish_reason = delta.finish_reason
                result.usage = delta.usage or result.usage
        result.text = "".join(texts)
        return result

    def _token_logprobs(self, req: OpenAIRequest, delta: TextDelta) -> TokenLogprobs | None:
        if not req.logprobs:
            return None
        tokens = self.service.tokens
        texts = tokens.token_texts(delta.model, delta.token_ids)
        raw = tokens.token_bytes(delta.model, delta.token_ids)
        tops = [
            list(
                zip(
                    tokens.token_texts(delta.model, [t for t, _ in top]),
                    [p for _, p in top],
                    tokens.token_bytes(delta.model, [t for t, _ in top]),
                    strict=True,
                )
            )
            for top in delta.top_logprobs
        ] or [[] for _ in texts]
        return TokenLogprobs(texts, delta.logprobs, tops, raw)

    async def _stream(
        self, request: web.Request, req: OpenAIRequest, admitted: list[Admitted]
    ) -> web.StreamResponse:
        events = self._merged(admitted)
        head: tuple[int, TextDelta, bool] | None = None
        if any(a.inp.sampling.constraint is not None for a in admitted):
            # The worker compiles the grammar and may refuse it before the first token:
            # headers wait for the first event, so that refusal is still an HTTP 400.
            head = await anext(events, None)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-request-id": request["request_id"],
            }
        )
        await response.prepare(request)
        usages: dict[int, Usage] = {}
        model = ""
        chunks = ChunkEncoder(req)
        try:
            async for index, delta, first in _after(head, events):
                model = delta.model
                lp = self._token_logprobs(req, delta)
                if delta.usage is not None:
                    usages[index] = delta.usage
                await response.write(chunks.encode(index, delta, lp, first))
            if req.include_usage:
                usage = request_usage([usages[i] for i in sorted(usages)])
                await _send(response, usage_chunk_json(req, model, usage_json(usage)))
        except UpstreamError as exc:
            _, body = error_body(exc.code, str(exc))
            await _send(response, body)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _merged(self, admitted: list[Admitted]) -> AsyncIterator[tuple[int, TextDelta, bool]]:
        """Every choice's deltas as they come, tagged with the choice index. One choice
        streams straight through: no task and no queue hop per chunk."""
        if len(admitted) == 1:
            first = True
            async for delta in self.service.stream(admitted[0], None):
                yield 0, delta, first
                first = False
            return
        queue: asyncio.Queue[tuple[int, TextDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, one: Admitted) -> None:
            try:
                async for delta in self.service.stream(one, None):
                    await queue.put((index, delta))
            except Exception as exc:
                await queue.put((index, exc))
            await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, a)) for i, a in enumerate(admitted)]
        started: set[int] = set()
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item, index not in started
                    started.add(index)
        finally:
            for task in tasks:
                task.cancel()

    async def models(self, request: web.Request) -> web.Response:
        principal = request["principal"]
        ready = await self.service.ready_models()
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": 0,
                "owned_by": "canteen",
                "version": m.version,
                "max_model_len": m.max_model_len,
                "is_ready": m.served.name in ready,
                # a LoRA adapter names its base model, as vLLM does; null for a full model
                "parent": m.base.name if m.base is not None else None,
            }
            for m in self.service.catalog.models()
            if principal.allows(m.name)
        ]
        return web.json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = _object(await self._body(request))
        refuse_unknown("", body, _TOKENIZE_FIELDS)
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
        model, ids = await self.service.tokens.tokenize(
            _model(body),
            prompt,
            None if messages is None else parse_messages(messages),
            request["principal"],
        )
        return web.json_response({"model": model, "tokens": ids, "count": len(ids)})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = _object(await self._body(request))
        refuse_unknown("", body, _DETOKENIZE_FIELDS)
        model, text = await self.service.tokens.detokenize(
            _model(body), body.get("tokens"), request["principal"]
        )
        return web.json_response({"model": model, "prompt": text})

    async def healthz(self, request: web.Request) -> web.Response:
        status = 503 if self.is_draining else 200
        return web.json_response(
            {"status": "draining" if self.is_draining else "ok"}, status=status
        )


def user_label(user: str) -> str:
    """The OpenAI ``user`` field as logged: a short hash, so it groups one user's requests
    without writing what the caller sent (it may be an e-mail address, or megabytes)."""
    return "u-" + hashlib.sha256(user.encode("utf-8", "replace")).hexdigest()[:16]


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidInputError("the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise InvalidInputError(f"model: expected a string, got {type(model).__name__}")
    return model


async def _after(head: T | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``head`` (when not None), then ``rest``."""
    if head is not None:
        yield head
    async for item in rest:
        yield item


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(sse(payload))


async def start_http(
    edge: HttpEdge,
    host: str,
    port: int,
    tls: tuple[str, str] | None = None,
    reuse_port: bool = False,
) -> web.AppRunner:
    """Serves the HTTP edge; ``tls`` (certificate and key files, PEM) makes it HTTPS."""
    runner = web.AppRunner(edge.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=_ssl_context(tls), reuse_port=reuse_port)
    await site.start()
    log.info("http listening", host=host, port=port, tls=tls is not None)
    return runner


def _ssl_context(tls: tuple[str, str] | None) -> ssl.SSLContext | None:
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*tls)
    return context
