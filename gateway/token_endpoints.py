"""The tokenize and detokenize endpoints (HTTP ``/tokenize``, gRPC ``Tokenize``), shared by
both edges: the same tokenizer and chat template as generation uses."""

from __future__ import annotations

from gateway.catalog import ModelCatalog
from gateway.config import GatewayConfig
from gateway.errors import InvalidInputError
from gateway.tokenizers import TemplateError, TokenizerCache
from gateway.validate import check_messages


class TokenEndpoints:
    def __init__(
        self, config: GatewayConfig, catalog: ModelCatalog, tokenizers: TokenizerCache
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.tokenizers = tokenizers

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
        check_messages(messages, self.config.max_messages, self.config.max_prompt_chars)
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
