"""Tokenizers per model version, loaded once (off the event loop) and shared."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from canteen.grammar import GrammarCompiler
from canteen.models import read_model_type
from canteen.plan import Constraint
from gateway.catalog import ModelVersion
from gateway.tool_parsers import HERMES, CallFormat, native_format
from gateway.tool_render import template_inputs
from gateway.tools import ChatMessage, ToolRequest


class TemplateError(ValueError):
    pass


def _check_unicode(text: str, name: str) -> None:
    """Lone surrogates (which JSON escapes allow) make the Rust tokenizer raise TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TemplateError(
            f"{name}: not valid Unicode (a lone surrogate at character {exc.start})"
        ) from None


class Tokenizer:
    def __init__(self, hf: Any, model_type: str = "") -> None:
        self.hf = hf
        self.vocab_size = len(hf)
        self.model_type = model_type
        # Built here, on the loading thread (about a second for a 49k vocabulary), so no
        # request pays for it; compiles then run on the preparation threads side by side.
        self.grammar = GrammarCompiler(hf)
        # A fast tokenizer's Rust core, called directly: encode_batch releases the GIL (so
        # the event loop runs meanwhile) and sets no truncation state another thread shares.
        self._rust = hf.backend_tokenizer if isinstance(hf, PreTrainedTokenizerFast) else None
        self.rust_decoder = _plain_rust_tokenizer(hf)  # None: transformers' decode
        # The call format the model's own template teaches; None: the fallback template.
        self.native_tool_format = native_format(model_type, str(hf.chat_template or ""))

    def tool_format(self, tools: ToolRequest) -> CallFormat:
        """How calls in the answer are written: the grammar's (and the fallback template's)
        hermes blocks, or the family's own format when its template rendered the tools."""
        if tools.is_forced or self.native_tool_format is None:
            return HERMES
        return self.native_tool_format

    def check_constraint(self, constraint: Constraint) -> Constraint:
        """The output constraint, carrying its grammar text for the worker (converted once
        per content, cached; thread-safe, and conversions of different constraints run at
        once); raises ConstraintError naming what the converter refused. The tokenizer-level
        compile is the worker's: a grammar it refuses fails the request before its first
        token, with the engine's reason."""
        return replace(constraint, converted=self.grammar.convert(constraint))

    def check_parameters(self, constraint: Constraint) -> None:
        """Compiles a tool's parameters schema for this tokenizer (cached by content), so a
        refusal names the tool; raises ConstraintError with the engine's reason."""
        self.grammar.compile(constraint)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (for logprobs): a byte-level token that is part of a
        UTF-8 character gives that byte, where its decoded text would be U+FFFD."""
        engine = self.grammar.tokenizer
        return [engine.decode_bytes([i]) for i in ids]

    def encode(self, text: str) -> list[int]:
        _check_unicode(text, "the text")
        if self._rust is not None:
            encoded: list[int] = self._rust.encode_batch([text], add_special_tokens=False)[0].ids
            return encoded
        ids: list[int] = self.hf(text, add_special_tokens=False)["input_ids"]
        return ids

    def render_chat(
        self, messages: list[ChatMessage], tools: ToolRequest | None = None
    ) -> list[int]:
        """The token ids of ``render_text``."""
        return self.encode(self.render_text(messages, tools))

    def render_text(self, messages: list[ChatMessage], tools: ToolRequest | None = None) -> str:
        """The prompt of ``messages`` (and the offered ``tools``) with a generation prompt;
        gateway/tool_render.py says how tools reach a template that does not know them."""
        if not getattr(self.hf, "chat_template", None):
            raise TemplateError("this model has no chat template; send a prompt instead")
        for i, message in enumerate(messages):
            for key in ("role", "content"):
                _check_unicode(str(message.get(key, "")), f"messages[{i}].{key}")
        conversation, extra = template_inputs(
            messages, tools, is_native=self.native_tool_format is not None
        )
        try:
            text = self.hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as exc:  # jinja raises its own exceptions for bad conversations
            raise TemplateError(f"messages: the chat template rejected them: {exc}") from exc
        return str(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Called twice per streamed token (gateway/text.py): straight to the Rust
        tokenizer where transformers' ``decode`` would return the same text, skipping a
        Python wrapper that costs three times the decode itself."""
        if self.rust_decoder is not None:
            text: str = self.rust_decoder.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def _plain_rust_tokenizer(hf: Any) -> Any:
    """``hf``'s Rust tokenizer when transformers' ``decode`` only wraps it: a fast tokenizer
    whose class changes no decode step and that cleans up no spaces; else None."""
    plain = (
        isinstance(hf, PreTrainedTokenizerFast)
        and type(hf).decode is PreTrainedTokenizerFast.decode
        and type(hf)._decode is PreTrainedTokenizerFast._decode
        and not getattr(hf, "clean_up_tokenization_spaces", True)
    )
    return hf.backend_tokenizer if plain else None


def _load(model: ModelVersion) -> Tokenizer:
    path = Path(model.path)
    if model.format == "gguf":
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        hf = AutoTokenizer.from_pretrained(str(path))
    return Tokenizer(hf, read_model_type(path))


class TokenizerCache:
    def __init__(self) -> None:
        self._loading: dict[str, asyncio.Task[Tokenizer]] = {}

    def loaded(self, model_ref: str) -> Tokenizer:
        """The tokenizer of a model version already loaded by ``get``."""
        task = self._loading[model_ref]
        return task.result()

    async def get(self, model: ModelVersion) -> Tokenizer:
        """The model's tokenizer (a LoRA adapter's is its base's), loaded once."""
        served = model.served
        task = self._loading.get(served.ref)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(_load, served))
            self._loading[served.ref] = task
        self._loading[model.ref] = task  # ``loaded`` finds it by the name responses carry
        try:
            return await asyncio.shield(task)
        except Exception:
            self._loading.pop(served.ref, None)
            self._loading.pop(model.ref, None)
            raise
