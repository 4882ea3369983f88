"""Admission: everything that can refuse a request before its first token.

``prepare`` resolves the model, tokenizes the prompt (or renders the chat template), checks
the grammars and the token limits; ``admit`` adds the key's allow list, the content screen
and the rate-limit reservation. What passes is an ``Admitted`` request, ready to stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from canteen.auth import ANONYMOUS, Principal
from canteen.grammar import ConstraintError
from canteen.plan import Constraint
from gateway.catalog import ModelCatalog, ModelVersion
from gateway.config import GatewayConfig
from gateway.errors import InvalidInputError, status_of
from gateway.limits import RateLimiter, Reservation
from gateway.metrics import GatewayMetrics
from gateway.prep_pool import PrepPool
from gateway.screen import Screen, screen_prompt
from gateway.tokenizers import TemplateError, Tokenizer, TokenizerCache
from gateway.tools import parameters_constraint
from gateway.validate import GenerateInput, check_shape

UNSET_MAX_TOKENS_RESERVE = 512  # tokens a request without max_tokens reserves for its answer
# Prompts up to this many characters (no tools, no constraint) take about a millisecond to
# prepare: done on the event loop, so they never wait behind a large one in the pool.
SMALL_PREP_CHARS = 8192


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


class Admission:
    def __init__(
        self,
        config: GatewayConfig,
        catalog: ModelCatalog,
        tokenizers: TokenizerCache,
        metrics: GatewayMetrics,
        screen: Screen | None = None,
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.screen = screen
        self.limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
        self.pool = PrepPool(config.prep_threads, config.prep_queue, config.prep_deadline)

    async def admit(self, inp: GenerateInput, principal: Principal = ANONYMOUS) -> Admitted:
        """One request through ``admit_all``."""
        return (await self.admit_all([inp], principal))[0]

    async def admit_all(
        self, inputs: Sequence[GenerateInput], principal: Principal = ANONYMOUS
    ) -> list[Admitted]:
        """Everything that can refuse a request's choices (the same prompt, tools and
        constraint, one input each) before any token: sizes, model, the key's allow list
        and rate limit, then the preparation, once for all. Refusals are counted by status."""
        try:
            return await self._admit_all(inputs, principal)
        except Exception as exc:
            code = status_of(exc)
            self.metrics.refused(code.name if code is not None else "INTERNAL")
            raise

    async def _admit_all(
        self, inputs: Sequence[GenerateInput], principal: Principal
    ) -> list[Admitted]:
        first = inputs[0]
        check_shape(first, self.config)
        for inp in inputs[1:]:
            if not _is_same_preparation(first, inp):
                raise ValueError("admit_all: the choices must share model, prompt and tools")
            check_shape(inp, self.config, is_schema_checked=True)
        model = self.catalog.resolve(first.model)
        principal.require_model(model.name)
        principal.require_priority(first.priority)
        # The rate limit before any work, on an estimate; trued up once tokenized.
        tpm = self.limiter.tpm if principal.tpm is None else principal.tpm
        estimate = _estimate_tokens(first, model.max_model_len)
        reservations: list[Reservation] = []
        try:
            for inp in inputs:
                reserved = estimate + (inp.max_tokens or UNSET_MAX_TOKENS_RESERVE)
                reservations.append(
                    self.limiter.reserve(
                        principal.key_id,
                        min(reserved, tpm) if tpm else reserved,
                        rpm=principal.rpm,
                        tpm=principal.tpm,
                    )
                )
            tokenizer = await self.tokenizers.get(model)
            prepare = partial(prepare_prompt, first, tokenizer, self.screen)
            if _is_small(first):  # a millisecond's work: never queued behind a large one
                ids, constraint = prepare()
            else:
                ids, constraint = await self.pool.run(
                    "preparing the prompt (tokenize, chat template, grammars)", prepare
                )
            if constraint is not None:  # with its grammar text, for the worker
                inputs = [with_constraint(inp, constraint) for inp in inputs]
            check_prompt_tokens(first, model, tokenizer, ids, self.config.max_prompt_tokens)
            max_tokens = first.max_tokens or min(
                model.max_model_len - len(ids),
                self.config.max_output_tokens or model.max_model_len,
            )
            for inp, reservation in zip(inputs, reservations, strict=True):
                # An unset max_tokens reserves a bounded guess; settle() charges what was used.
                used = len(ids) + (inp.max_tokens or min(max_tokens, UNSET_MAX_TOKENS_RESERVE))
                self.limiter.true_up(reservation, used, tpm=principal.tpm)
        except BaseException:
            for reservation in reservations:
                reservation.settle(0)
            raise
        # --cache-isolation key: each key's prompts hash apart, so cached_tokens and timing
        # say nothing about what another key sent.
        salt = principal.key_id if self.config.cache_isolation == "key" else ""
        return [
            Admitted(inp, model, tokenizer, ids, max_tokens, r, salt)
            for inp, r in zip(inputs, reservations, strict=True)
        ]


def _is_same_preparation(a: GenerateInput, b: GenerateInput) -> bool:
    """Whether ``b`` is prepared as ``a`` is (choices of one request share these objects)."""
    return (
        a.model == b.model
        and a.prompt is b.prompt
        and a.messages is b.messages
        and a.tools is b.tools
        and a.sampling.constraint is b.sampling.constraint
        and a.stop_token_ids == b.stop_token_ids
        and a.priority == b.priority
    )


def is_small_text(chars: int) -> bool:
    return chars <= SMALL_PREP_CHARS


def _is_small(inp: GenerateInput) -> bool:
    """A short prompt with no tools and no output constraint, prepared on the event loop."""
    chars = len(inp.prompt) if inp.prompt is not None else check_messages_chars(inp)
    return is_small_text(chars) and inp.tools is None and inp.sampling.constraint is None


def _estimate_tokens(inp: GenerateInput, max_model_len: int) -> int:
    """The prompt's tokens guessed from its characters (about four a token), at most the
    model's context; the reservation is trued up to the real count once tokenized."""
    chars = len(inp.prompt) if inp.prompt is not None else check_messages_chars(inp)
    return min(chars // 4 + 1, max_model_len)


def check_messages_chars(inp: GenerateInput) -> int:
    return sum(len(str(m.get("content", ""))) for m in inp.messages or ())


def with_constraint(inp: GenerateInput, constraint: Constraint) -> GenerateInput:
    return replace(inp, sampling=replace(inp.sampling, constraint=constraint))


def prepare_prompt(
    inp: GenerateInput, tokenizer: Tokenizer, screen: Screen | None
) -> tuple[list[int], Constraint | None]:
    """The CPU-heavy part, on a preparation thread: the prompt's token ids (the chat
    template rendered), every grammar converted (the output constraint returned with its
    grammar text), the content screen on what the model reads."""
    try:
        if inp.prompt is not None:
            text, ids = inp.prompt, tokenizer.encode(inp.prompt)
        else:
            text = tokenizer.render_text(inp.messages or [], inp.tools)
            ids = tokenizer.encode(text)
    except TemplateError as exc:
        raise InvalidInputError(str(exc)) from exc
    if not ids:
        raise InvalidInputError("the prompt is empty after tokenization")
    constraint = check_grammars(inp, tokenizer)
    if screen is not None:
        reason = screen_prompt(screen, inp.prompt, inp.messages)
        if reason is None and inp.messages is not None:
            # The rendered prompt: tool descriptions and earlier calls' arguments included.
            found = screen.screen_input(text)
            reason = None if found is None else f"the rendered chat prompt: {found}"
        if reason is not None:
            raise InvalidInputError(reason)
    return ids, constraint


def check_grammars(inp: GenerateInput, tokenizer: Tokenizer) -> Constraint | None:
    """Compiles each tool's parameters (refused naming the field) and converts the output
    constraint (a forced tool call's grammar included) to the grammar text it returns it
    with: the worker's compile of that text is the one tokenizer-level check it gets."""
    offered = inp.tools.functions if inp.tools is not None and inp.tools.is_offered else ()
    for i, function in enumerate(offered):
        try:
            tokenizer.check_parameters(parameters_constraint(function))
        except ConstraintError as exc:
            raise InvalidInputError(f"tools[{i}].function.parameters: {exc}") from None
    if (constraint := inp.sampling.constraint) is None:
        return None
    try:
        return tokenizer.check_constraint(constraint)
    except ConstraintError as exc:
        raise InvalidInputError(str(exc)) from None


def check_prompt_tokens(
    inp: GenerateInput,
    model: ModelVersion,
    tokenizer: Tokenizer,
    ids: list[int],
    max_prompt_tokens: int,
) -> None:
    """The prompt's tokens against --max-prompt-tokens and the model's context."""
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        raise InvalidInputError(
            f"prompt has {len(ids)} tokens; the limit is {max_prompt_tokens} (--max-prompt-tokens)"
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
