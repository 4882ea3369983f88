"""The openai client against a suite's HTTP edge, and a chat call with test defaults."""

from __future__ import annotations

from typing import Any

import openai

HELLO = [{"role": "user", "content": "Hello there"}]


def openai_client(http_url: str) -> openai.OpenAI:
    """A client of the gateway at ``http_url`` that never retries (tests see every error)."""
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, default_max_tokens: int, /, **kwargs: Any) -> Any:
    """A chat completion of ``HELLO`` on the tiny model; ``kwargs`` override the defaults."""
    kwargs = {"model": "tiny", "messages": HELLO, "max_tokens": default_max_tokens, **kwargs}
    return client.chat.completions.create(**kwargs)
