"""Structured output on the real model, the way an application asks for it: the openai
client's ``parse()`` with a pydantic model."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import SmolSuite

pytestmark = pytest.mark.e2e


class City(BaseModel):
    name: str
    country: str
    population_millions: float
    kind: Literal["capital", "city", "village"]


def test_openai_parse_returns_a_parsed_object(smol: SmolSuite) -> None:
    client = openai.OpenAI(base_url=f"{smol.gateway.http_url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        messages=[
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Describe Paris, the capital of France."},
        ],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City), choice.message.content
    assert city.name.strip() and city.kind in ("capital", "city", "village")
    assert "Paris" in city.name
