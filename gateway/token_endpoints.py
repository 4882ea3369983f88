"""The tokenize and detokenize endpoints (HTTP ``/tokenize``, gRPC ``Tokenize``), shared by
both edges: the same tokenizer and chat template as generation uses, under the same keys,
limits, per-key model lists, rate limit and preparation pool."""

from __future__ import annotations

from functools import partial

from canteen.auth import ANONYMOUS, Principal
from gateway.admission import Admission, is_small_text
from gateway.catalog import ModelVersion
from gateway.errors import InvalidInputError, status_of
from gateway.limits import Reservation
from gateway.tokenizers import TemplateError, Tokenizer
from gateway.tools import ChatMessage
from gateway.validate import check_messages, check_prompt


class TokenEndpoints:
    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.config = admission.config

    async def tokenize(
        self, model_name: str, prompt: object, messages: object, principal: Principal = ANONYMOUS
    ) -> tuple[str, list[int]]:
        """Token ids of ``prompt`` or of ``messages`` rendered with the chat template."""
        if (prompt is None) == (messages is None):
            raise InvalidInputError("exactly one of prompt or messages is required")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidInputError("prompt: expected a string")
            check_prompt(prompt, self.config.max_prompt_chars)
            chars = len(prompt)
        else:
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages
            ):
                raise InvalidInputError("messages: expected a list of {role, content} objects")
            check_messages(messages, self.config.max_messages, self.config.max_prompt_chars)
            chars = sum(len(m.get("content", "")) for m in messages)
        model, tokenizer, reservation = await self._begin(model_name, principal, chars // 4 + 1)
        work = partial(_tokenize, tokenizer, prompt, messages)
        try:
            ids = (
                work()
                if is_small_text(chars)
                else await self.admission.pool.run("tokenizing", work)
            )
        except BaseException:
            reservation.settle(0)
            raise
        reservation.settle(len(ids))
        return model.ref, ids

    async def detokenize(
        self, model_name: str, token_ids: object, principal: Principal = ANONYMOUS
    ) -> tuple[str, str]:
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidInputError("tokens: expected a list of integer token ids")
        limit = self.config.max_prompt_chars
        if len(token_ids) > limit:
            raise InvalidInputError(
                f"tokens has {len(token_ids)} ids; the limit is {limit} (--max-prompt-chars)",
                param="tokens",
            )
        model, tokenizer, reservation = await self._begin(model_name, principal, len(token_ids))
        try:
            for t in token_ids:
                if not 0 <= t < tokenizer.vocab_size:
                    raise InvalidInputError(
                        f"tokens: {t} is outside the vocabulary of {tokenizer.vocab_size}"
                    )
            work = partial(tokenizer.decode, token_ids)
            small = is_small_text(len(token_ids))
            text = work() if small else await self.admission.pool.run("detokenizing", work)
        finally:
            reservation.settle(len(token_ids))
        return model.ref, text

    async def _begin(
        self, model_name: str, principal: Principal, num_tokens: int
    ) -> tuple[ModelVersion, Tokenizer, Reservation]:
        """The model (the key must be allowed it), its tokenizer, and one request plus
        ``num_tokens`` (an estimate, settled with the real count) taken from the key's
        rate limit. Refusals are counted by status, as generation's are."""
        try:
            model = self.admission.catalog.resolve(model_name)
            principal.require_model(model.name)
            limiter = self.admission.limiter
            tpm = limiter.tpm if principal.tpm is None else principal.tpm
            reservation = limiter.reserve(
                principal.key_id,
                min(num_tokens, tpm) if tpm else num_tokens,
                rpm=principal.rpm,
                tpm=principal.tpm,
            )
        except Exception as exc:
            code = status_of(exc)
            self.admission.metrics.refused(code.name if code is not None else "INTERNAL")
            raise
        try:
            tokenizer = await self.admission.tokenizers.get(model)
        except BaseException:
            reservation.settle(0)
            raise
        return model, tokenizer, reservation

    def token_texts(self, model_ref: str, token_ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs), from the already loaded tokenizer."""
        tokenizer = self.admission.tokenizers.loaded(model_ref)
        return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def token_bytes(self, model_ref: str, token_ids: list[int]) -> list[bytes]:
        """Each token's own bytes (for logprobs), from the already loaded tokenizer."""
        return self.admission.tokenizers.loaded(model_ref).token_bytes(token_ids)


def _tokenize(tokenizer: Tokenizer, prompt: object, messages: object) -> list[int]:
    try:
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        chat: list[ChatMessage] = messages  # type: ignore[assignment]  # checked by the caller
        return tokenizer.render_chat(chat)
    except TemplateError as exc:
        raise InvalidInputError(str(exc)) from exc
