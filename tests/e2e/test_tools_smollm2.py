"""Tool calling on the real default model (SmolLM2-135M-Instruct), whose chat template knows
no tools: the fallback template offers them and the grammar forces the call."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.conftest import SmolSuite

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]


def test_a_required_call_on_smollm2_parses_and_its_result_is_answered(smol: SmolSuite) -> None:
    client = openai.OpenAI(base_url=f"{smol.gateway.http_url}/v1", api_key="x", max_retries=0)
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ask,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls: list[Any] = list(choice.message.tool_calls or [])
    (call,) = calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    history: list[Any] = [
        *ask,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    text = answer.choices[0].message.content or ""
    # greedy on this model: "The weather in Paris, in Celsius, is 21."
    assert "21" in text and answer.choices[0].message.tool_calls is None
