"""Admission: everything that can refuse a request before its first token.

``prepare`` resolves the model, tokenizes the prompt (or renders the chat template), checks
the grammars and the token limits; ``admit`` adds the key's allow list, the content screen
and the rate-limit reservation. What passes is an ``Admitted`` request, ready to stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from canteen.auth import ANONYMOUS, Principal
from canteen.grammar import ConstraintError
from gateway.catalog import ModelCatalog, ModelVersion
from gateway.config import GatewayConfig
from gateway.errors import InvalidInputError, status_of
from gateway.limits import RateLimiter, Reservation
from gateway.metrics import GatewayMetrics
from gateway.screen import Screen, screen_prompt
from gateway.tokenizers import TemplateError, Tokenizer, TokenizerCache
from gateway.tools import parameters_constraint
from gateway.validate import GenerateInput, check_shape

UNSET_MAX_TOKENS_RESERVE = 512  # tokens a request without max_tokens reserves for its answer


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

    async def prepare(self, inp: GenerateInput) -> tuple[ModelVersion, Tokenizer, list[int]]:
        check_shape(inp, self.config)
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
        check_grammars(inp, tokenizer)
        check_prompt_tokens(inp, model, tokenizer, ids, self.config.max_prompt_tokens)
        return model, tokenizer, ids

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


def check_grammars(inp: GenerateInput, tokenizer: Tokenizer) -> None:
    """Compiles each tool's parameters and the output constraint; refuses naming the field."""
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
