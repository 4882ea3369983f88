"""Structured output and tool calls as OpenAI and vLLM users expect them (issue 34).

The tiny model's weights are random, so each assertion holds by construction of the
grammar: what the model may write is what the test checks.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import openai
import pytest

from tests.integration.conftest import TinySuite

HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(suite: TinySuite) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{suite.gateway.http_url}/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": "tiny", "messages": HELLO, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(**kwargs)


def test_regex_classes_are_ascii(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = _chat(client, seed=seed, extra_body={"guided_regex": r"\w{16}\s\d{6}"})
        text = reply.choices[0].message.content
        assert re.fullmatch(r"[0-9A-Za-z_]{16}[\t\n\v\f\r ][0-9]{6}", text), text
        assert reply.choices[0].finish_reason == "stop"


def test_regex_unicode_opt_in(client: openai.OpenAI) -> None:
    # with (?u), \d minus 0-9 is every other decimal digit of Unicode
    reply = _chat(client, seed=0, extra_body={"guided_regex": r"(?u)[\d&&[^0-9]]{3}"})
    text = reply.choices[0].message.content
    assert len(text) == 3, text
    assert all(unicodedata.category(c) == "Nd" and not c.isascii() for c in text), text
