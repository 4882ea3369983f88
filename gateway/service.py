"""The gateway's request path: validate, resolve the model, tokenize, stream text back.

Text is the gateway's business: it renders chat templates, counts prompt tokens, turns
streamed token ids into UTF-8-safe text and ends the stream at the first stop string,
cancelling the request upstream so its blocks are freed at once.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span

from canteen.auth import ANONYMOUS, Principal
from canteen.codec import request_to_pb
from canteen.grammar import ConstraintError
from canteen.logging import get_logger
from canteen.plan import Sampling
from canteen.request import Request
from canteen.tracing import context_from_traceparent, get_tracer, trace_id_of, trace_metadata
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc
from gateway.catalog import ModelCatalog, ModelVersion
from gateway.config import GatewayConfig
from gateway.errors import InvalidInputError, UpstreamError, status_of
from gateway.limits import RateLimiter, Reservation
from gateway.metrics import GatewayMetrics
from gateway.output import Output, TextDelta, with_tool_calls
from gateway.screen import Screen, screen_prompt
from gateway.tokenizers import TemplateError, Tokenizer, TokenizerCache
from gateway.tool_parsers import ToolStream
from gateway.tools import (
    ChatMessage,
    ToolRequest,
    check_role,
    parameters_constraint,
)
from gateway.upstream import SchedulerClient

log = get_logger(__name__)
tracer = get_tracer("canteen.gateway")

UNSET_MAX_TOKENS_RESERVE = 512  # tokens a request without max_tokens reserves for its answer


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def choose_request_id(given: str) -> str:
    """The caller's x-request-id when it is a sane token, else a fresh one."""
    return given if _REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)  # seeded: the edge draws a seed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    disable_speculation: bool = False
    traceparent: str = ""  # the caller's W3C trace context, if it sent one
    arrival: float = field(default_factory=time.monotonic)
    # Functions the model may call (chat only); a forced choice's grammar is in sampling.
    tools: ToolRequest | None = None
    # Set by the HTTP edge's parser, which checks sampling before the fields that follow it;
    # the gateway checks each request's sampling once (the scheduler and worker again).
    is_sampling_checked: bool = False


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check and holds its rate-limit reservation."""

    inp: GenerateInput
    model: ModelVersion
    tokenizer: Tokenizer
    ids: list[int]
    max_tokens: int
    reservation: Reservation
    cache_salt: str = ""  # the prefix cache's tenant (--cache-isolation key); "" shared


class InferenceService:
    def __init__(
        self,
        config: GatewayConfig,
        catalog: ModelCatalog,
        tokenizers: TokenizerCache,
        scheduler: scheduler_pb2_grpc.SchedulerStub,
        metrics: GatewayMetrics,
        screen: Screen | None = None,
    ) -> None:
        self.metrics = metrics
        self.config = config
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        shared = config.scheduler_stream == "shared"
        self.upstream = SchedulerClient(scheduler, config.scheduler_retry, shared)
        self.screen = screen
        self.limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)

    async def ready_models(self) -> set[str]:
        """Names of the models a ready worker serves now (empty when the scheduler is away)."""
        try:
            stats = await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return set()
        return {w.model for w in stats.workers if w.is_ready}

    def check_shape(self, inp: GenerateInput) -> None:
        """Checks what needs no tokenizer; raises InvalidInputError naming field and limit."""
        c = self.config
        if (inp.prompt is None) == (inp.messages is None):
            raise InvalidInputError("exactly one of prompt or messages is required")
        if inp.prompt is not None:
            if not inp.prompt:
                raise InvalidInputError("prompt must not be empty")
            if len(inp.prompt) > c.max_prompt_chars:
                raise InvalidInputError(
                    f"prompt has {len(inp.prompt)} characters; the limit is {c.max_prompt_chars}"
                )
        if inp.messages is not None:
            _check_messages(inp.messages, c.max_messages, c.max_prompt_chars)
        if inp.tools is not None and inp.tools.functions and inp.messages is None:
            raise InvalidInputError("tools: need chat messages, not a prompt")
        if inp.max_tokens is not None and inp.max_tokens < 1:
            raise InvalidInputError(f"max_tokens={inp.max_tokens}: must be >= 1")
        if (
            c.max_output_tokens
            and inp.max_tokens is not None
            and inp.max_tokens > c.max_output_tokens
        ):
            raise InvalidInputError(
                f"max_tokens={inp.max_tokens}: the limit is {c.max_output_tokens} "
                "(--max-output-tokens)"
            )
        if not inp.is_sampling_checked and (problem := inp.sampling.problem()) is not None:
            raise InvalidInputError(problem)
        if len(inp.stop) > c.max_stop_strings:
            raise InvalidInputError(
                f"stop has {len(inp.stop)} strings; the limit is {c.max_stop_strings}"
            )
        for text in inp.stop:
            if not text or len(text) > c.max_stop_length:
                raise InvalidInputError(
                    f"stop strings must have 1..{c.max_stop_length} characters, got {len(text)}"
                )

    async def prepare(self, inp: GenerateInput) -> tuple[ModelVersion, Tokenizer, list[int]]:
        self.check_shape(inp)
        model = self.catalog.resolve(inp.model)
        tokenizer = await self.tokenizers.get(model)
        try:
            ids = (
                tokenizer.encode(inp.prompt)
                if inp.prompt is not None
                else tokenizer.render_chat(inp.messages or [], inp.tools)
            )
        except TemplateError as exc:
            raise InvalidInputError(str(exc)) from exc
        if not ids:
            raise InvalidInputError("the prompt is empty after tokenization")
        for i, function in enumerate(inp.tools.functions if inp.tools is not None else ()):
            try:
                tokenizer.check_constraint(parameters_constraint(function))
            except ConstraintError as exc:
                raise InvalidInputError(f"tools[{i}].function.parameters: {exc}") from None
        if (constraint := inp.sampling.constraint) is not None:
            try:
                tokenizer.check_constraint(constraint)
            except ConstraintError as exc:
                raise InvalidInputError(str(exc)) from None
        if self.config.max_prompt_tokens and len(ids) > self.config.max_prompt_tokens:
            raise InvalidInputError(
                f"prompt has {len(ids)} tokens; the limit is {self.config.max_prompt_tokens} "
                "(--max-prompt-tokens)"
            )
        limit = model.max_model_len
        if len(ids) >= limit:
            raise InvalidInputError(
                f"prompt has {len(ids)} tokens; the model's context is {limit} tokens "
                "(prompt plus at least one new token must fit)"
            )
        if inp.max_tokens is not None and len(ids) + inp.max_tokens > limit:
            raise InvalidInputError(
                f"prompt ({len(ids)} tokens) + max_tokens ({inp.max_tokens}) exceeds the "
                f"model's context of {limit} tokens"
            )
        for token in inp.stop_token_ids:
            if not 0 <= token < tokenizer.vocab_size:
                raise InvalidInputError(
                    f"stop_token_ids: {token} is outside the vocabulary of {tokenizer.vocab_size}"
                )
        return model, tokenizer, ids

    async def tokenize(
        self, model_name: str, prompt: object, messages: object
    ) -> tuple[str, list[int]]:
        """Token ids of ``prompt`` or of ``messages`` rendered with the chat template."""
        if (prompt is None) == (messages is None):
            raise InvalidInputError("exactly one of prompt or messages is required")
        model = self.catalog.resolve(model_name)
        tokenizer = await self.tokenizers.get(model)
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidInputError("prompt: expected a string")
            return model.ref, tokenizer.encode(prompt)
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages
        ):
            raise InvalidInputError("messages: expected a list of {role, content} objects")
        _check_messages(messages, self.config.max_messages, self.config.max_prompt_chars)
        try:
            return model.ref, tokenizer.render_chat(messages)
        except TemplateError as exc:
            raise InvalidInputError(str(exc)) from exc

    async def detokenize(self, model_name: str, token_ids: object) -> tuple[str, str]:
        model = self.catalog.resolve(model_name)
        tokenizer = await self.tokenizers.get(model)
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidInputError("tokens: expected a list of integer token ids")
        for t in token_ids:
            if not 0 <= t < tokenizer.vocab_size:
                raise InvalidInputError(
                    f"tokens: {t} is outside the vocabulary of {tokenizer.vocab_size}"
                )
        return model.ref, tokenizer.decode(token_ids)

    def token_texts(self, model_ref: str, token_ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs), from the already loaded tokenizer."""
        tokenizer = self.tokenizers.loaded(model_ref)
        return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    async def admit(self, inp: GenerateInput, principal: Principal = ANONYMOUS) -> Admitted:
        """Everything that can refuse a request before any token: shape, model, the key's
        allow list, the content screen, the rate limit. Refusals are counted by status."""
        try:
            return await self._admit(inp, principal)
        except Exception as exc:
            code = status_of(exc)
            self.metrics.refused(code.name if code is not None else "INTERNAL")
            raise

    async def _admit(self, inp: GenerateInput, principal: Principal) -> Admitted:
        model, tokenizer, ids = await self.prepare(inp)
        principal.require_model(model.name)
        principal.require_priority(inp.priority)
        if self.screen is not None:
            reason = screen_prompt(self.screen, inp.prompt, inp.messages)
            if reason is not None:
                raise InvalidInputError(reason)
        max_tokens = inp.max_tokens or min(
            model.max_model_len - len(ids), self.config.max_output_tokens or model.max_model_len
        )
        # An unset max_tokens reserves a bounded guess; settle() charges what was used.
        reserved = len(ids) + (inp.max_tokens or min(max_tokens, UNSET_MAX_TOKENS_RESERVE))
        reservation = self.limiter.reserve(
            principal.key_id, reserved, rpm=principal.rpm, tpm=principal.tpm
        )
        # --cache-isolation key: each key's prompts hash apart, so cached_tokens and timing
        # say nothing about what another key sent.
        salt = principal.key_id if self.config.cache_isolation == "key" else ""
        return Admitted(inp, model, tokenizer, ids, max_tokens, reservation, salt)

    async def generate(
        self, inp: GenerateInput, timeout: float | None, principal: Principal = ANONYMOUS
    ) -> AsyncIterator[TextDelta]:
        admitted = await self.admit(inp, principal)
        async for delta in self.stream(admitted, timeout):
            yield delta

    async def stream(self, admitted: Admitted, timeout: float | None) -> AsyncIterator[TextDelta]:
        """Runs an admitted request, timed and traced; its reservation is settled with the
        tokens it used."""
        inp, model = admitted.inp, admitted.model
        timer = self.metrics.track(model.name, model.version, inp.arrival)
        span = tracer.start_span(
            "gateway.generate",
            context=context_from_traceparent(inp.traceparent),
            start_time=time.time_ns() - int((time.monotonic() - inp.arrival) * 1e9),
            attributes={"canteen.model": model.ref, "canteen.num_prompt_tokens": len(admitted.ids)},
        )
        self.metrics.in_flight.inc()
        status, cached = "CANCELLED", 0
        deltas = self._run(admitted, timeout, span)
        if inp.tools is not None and inp.tools.is_offered:
            split = ToolStream(admitted.tokenizer.tool_format(inp.tools), inp.tools.names)
            deltas = with_tool_calls(deltas, split)
        try:
            async for delta in deltas:
                timer.tokens(len(delta.token_ids))
                if delta.finish_reason is not None:
                    status = "OK"
                    cached = delta.usage.cached_tokens if delta.usage is not None else 0
                yield delta
        except UpstreamError as exc:
            status = exc.code.name
            raise
        finally:
            self.metrics.in_flight.dec()
            timer.finish(status, len(admitted.ids), cached)
            span.set_attribute("canteen.num_output_tokens", timer.num_tokens)
            span.set_attribute("canteen.status", status)
            span.end()

    async def _run(
        self, admitted: Admitted, timeout: float | None, span: Span
    ) -> AsyncIterator[TextDelta]:
        inp, model, ids = admitted.inp, admitted.model, admitted.ids
        request = request_to_pb(
            Request(
                request_id=inp.request_id,
                model=model.name,
                version=model.version,
                prompt_token_ids=tuple(ids),
                stop_token_ids=tuple(inp.stop_token_ids),
                max_tokens=admitted.max_tokens,
                sampling=inp.sampling,
                ignore_eos=inp.ignore_eos,
                priority=inp.priority,
                cache_salt=admitted.cache_salt,
                disable_speculation=inp.disable_speculation,
            )
        )
        log.info(
            "request accepted",
            trace_id=trace_id_of(span),
            model=model.ref,
            num_prompt_tokens=len(ids),
            max_tokens=admitted.max_tokens,
        )
        output = Output(admitted.tokenizer, inp.stop, self.screen, model.ref, len(ids))
        metadata = (("x-request-id", inp.request_id), *trace_metadata(span))
        try:
            async for msg in self.upstream.stream(request, timeout, metadata):
                delta = output.push(msg)
                if delta.finish_reason is not None:
                    yield delta
                    return
                if delta.text or delta.token_ids:
                    yield delta
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code(), exc.details() or "scheduler error") from exc
        finally:
            admitted.reservation.settle(len(ids) + output.num_tokens)


def _check_messages(
    messages: Sequence[Mapping[str, object]], max_messages: int, max_chars: int
) -> None:
    if not messages:
        raise InvalidInputError("messages must not be empty")
    if len(messages) > max_messages:
        raise InvalidInputError(
            f"messages has {len(messages)} entries; the limit is {max_messages}"
        )
    total = 0
    for i, message in enumerate(messages):
        check_role(i, message.get("role"))
        total += len(str(message.get("content", "")))
    if total > max_chars:
        raise InvalidInputError(f"messages have {total} characters; the limit is {max_chars}")
