"""Tool calling without a model: parsers per family, the streaming splitter, the grammar that
forces a call, the prompt rendering and the request checks."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest

from canteen.grammar import GrammarCompiler
from gateway.errors import InvalidInputError
from gateway.openai_api import parse_request
from gateway.tokenizers import Tokenizer
from gateway.tool_parsers import (
    HERMES,
    LLAMA3,
    MISTRAL,
    CallFormat,
    ToolStream,
    native_format,
    parse_hermes,
    parse_llama3,
    parse_mistral,
)
from gateway.tools import (
    MAX_PARALLEL_CALLS,
    ChatMessage,
    Function,
    ToolCall,
    ToolRequest,
    call_grammar,
)
from tests.support.tiny_model import build_tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
NAMES = frozenset({"get_weather", "get_time"})
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]


def _args(call: ToolCall) -> dict[str, Any]:
    value = json.loads(call.arguments)
    assert isinstance(value, dict)
    return value


# -- parsers per family ----------------------------------------------------------------------


def test_hermes_finds_blocks_after_text_and_keeps_the_text() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    )
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me look."
    assert [(c.name, _args(c)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_hermes_accepts_an_unclosed_last_block_and_leaves_bad_ones_as_text() -> None:
    _, calls = parse_hermes('<tool_call>\n{"name": "get_time", "arguments": {}}', NAMES)
    assert [c.name for c in calls] == ["get_time"]
    for bad in (
        '<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # not JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # not an object
    ):
        assert parse_hermes(bad, NAMES) == (bad, [])


def test_llama3_json_with_parameters_python_tag_and_semicolons() -> None:
    _, calls = parse_llama3('{"name": "get_weather", "parameters": {"city": "Rome"}}', NAMES)
    assert [(c.name, _args(c)) for c in calls] == [("get_weather", {"city": "Rome"})]
    text = (
        '<|python_tag|>{"name": "get_time", "parameters": {}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    )
    assert [c.name for c in parse_llama3(text, NAMES)[1]] == ["get_time", "get_weather"]
    for plain in ("It is sunny.", '{"name": "get_time"} and more', '{"answer": 4}'):
        assert parse_llama3(plain, NAMES) == (plain, [])


def test_mistral_tool_calls_list_with_or_without_its_token() -> None:
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    content, calls = parse_mistral(text, NAMES)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    stripped = '[{"name": "get_time", "arguments": {}}]'  # [TOOL_CALLS] is a special token
    assert [c.name for c in parse_mistral(stripped, NAMES)[1]] == ["get_time"]
    assert parse_mistral("[1, 2, 3]", NAMES) == ("[1, 2, 3]", [])


# -- the streaming splitter ------------------------------------------------------------------


def _stream(fmt: CallFormat, text: str, step: int = 1) -> tuple[list[str], str, list[ToolCall]]:
    split = ToolStream(fmt, NAMES)
    released = [split.push(text[i : i + step]) for i in range(0, len(text), step)]
    rest, calls = split.finish()
    return released, rest, calls


def test_hermes_stream_releases_text_and_holds_a_marker_split_across_pieces() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    released, rest, calls = _stream(HERMES, "Sure <tool thing. " + call)
    assert "".join(released) + rest == "Sure <tool thing. "
    assert [c.name for c in calls] == ["get_time"]
    assert all("<tool_call>" not in r for r in released)
    # no call: everything is content, the held tail comes out at the end
    released, rest, calls = _stream(HERMES, "Just text <tool_ca")
    assert "".join(released) + rest == "Just text <tool_ca" and calls == []


@pytest.mark.parametrize(
    ("fmt", "text", "name"),
    [
        (LLAMA3, '  {"name": "get_time", "parameters": {}}', "get_time"),
        (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "get_time"),
    ],
)
def test_whole_answer_formats_buffer_from_the_start(fmt: CallFormat, text: str, name: str) -> None:
    released, rest, calls = _stream(fmt, text, step=3)
    assert "".join(released) == "" and rest == "" and [c.name for c in calls] == [name]
    released, rest, calls = _stream(fmt, "Hello {world}", step=2)
    assert "".join(released) == "Hello {world}" and calls == []
    # a JSON-looking answer that is no call is held, then given back whole
    released, rest, calls = _stream(fmt, "[1] {2}")
    assert "".join(released) + rest == "[1] {2}" and calls == []


# -- which family ----------------------------------------------------------------------------


def test_native_format_by_family_when_the_template_knows_tools() -> None:
    knows = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"
    assert native_format("qwen2", knows) is HERMES
    assert native_format("qwen3", knows) is HERMES
    assert native_format("llama", knows) is LLAMA3
    assert native_format("mistral", knows) is MISTRAL
    assert native_format("llama", knows + "<tool_call>") is HERMES  # a Hermes fine-tune
    assert native_format("gpt_neox", knows) is None  # unknown family: the fallback template
    assert native_format("qwen2", "{{ messages }}") is None  # the template knows no tools


# -- the grammar that forces a call -----------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer() -> Any:
    return llguidance.hf.from_tokenizer(build_tokenizer())


def _accepts(ll_tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    ids = build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


def test_call_grammar_accepts_valid_calls_only(ll_tokenizer: Any) -> None:
    functions = (Function("get_weather", "", WEATHER), Function("get_time"))
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    required = llguidance.grammar_from("grammar", call_grammar(ToolRequest(functions, "required")))
    assert _accepts(ll_tokenizer, required, weather)
    assert _accepts(ll_tokenizer, required, weather + "\n" + time)  # parallel by default
    assert not _accepts(ll_tokenizer, required, weather.replace("Paris", "Oslo"))
    assert not _accepts(ll_tokenizer, required, "Hello")
    single = ToolRequest(functions, "required", parallel=False)
    assert not _accepts(
        ll_tokenizer,
        llguidance.grammar_from("grammar", call_grammar(single)),
        weather + "\n" + time,
    )
    named = ToolRequest(functions, "function", "get_time")
    named_grammar = llguidance.grammar_from("grammar", call_grammar(named))
    assert _accepts(ll_tokenizer, named_grammar, time)
    assert not _accepts(ll_tokenizer, named_grammar, weather)
    assert not _accepts(ll_tokenizer, named_grammar, time + "\n" + time)  # exactly one call


def test_required_parallel_calls_are_bounded(ll_tokenizer: Any) -> None:
    time = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    grammar = call_grammar(ToolRequest((Function("get_time"),), "required"))
    checked = llguidance.grammar_from("grammar", grammar)
    most = "\n".join([time] * MAX_PARALLEL_CALLS)
    assert _accepts(ll_tokenizer, checked, most)
    assert not _accepts(ll_tokenizer, checked, most + "\n" + time)


def test_call_grammar_keeps_refs_to_the_parameters_defs(ll_tokenizer: Any) -> None:
    params = {
        "type": "object",
        "$defs": {"city": {"enum": ["Paris", "Rome"]}},
        "properties": {"city": {"$ref": "#/$defs/city"}},
        "required": ["city"],
    }
    grammar = llguidance.grammar_from(
        "grammar", call_grammar(ToolRequest((Function("f", "", params),), "required"))
    )
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    ok = '<tool_call>\n{"name": "f", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert _accepts(ll_tokenizer, grammar, ok)
    assert not _accepts(ll_tokenizer, grammar, ok.replace("Rome", "Oslo"))


def test_the_grammar_compiles_with_the_gateways_compiler() -> None:
    req = parse_request("chat", {"messages": HELLO, "tools": TOOLS, "tool_choice": "required"}, "r")
    constraint = req.inputs[0].sampling.constraint
    assert constraint is not None and constraint.kind == "grammar"
    GrammarCompiler(build_tokenizer()).compile(constraint)


# -- rendering -------------------------------------------------------------------------------

HISTORY: list[ChatMessage] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [ToolCall("get_weather", '{"city": "Paris"}', id="call_1")],
    },
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]


def test_fallback_template_lists_tools_and_renders_calls_and_results() -> None:
    tok = Tokenizer(build_tokenizer(), "llama")
    assert tok.native_tool_format is None
    tools = ToolRequest((Function("get_weather", "Weather now", WEATHER),), "auto")
    text = tok.decode(tok.render_chat(HISTORY, tools), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou can call these functions:\n")
    assert '\n{"name":"get_weather","description":"Weather now","parameters":{"type"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text
    # tool_choice none: the history renders, no tools are offered
    plain = tok.decode(tok.render_chat(HISTORY, ToolRequest(tools.functions, "none")), False)
    assert "You can call" not in plain and "<tool_response>" in plain


def test_native_template_gets_tools_and_structured_calls() -> None:
    hf = build_tokenizer()
    hf.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}<|im_end|>"
        "{% endfor %}<|im_start|>assistant\n"
    )
    tok = Tokenizer(hf, "qwen2")
    assert tok.native_tool_format is HERMES
    tools = ToolRequest((Function("get_weather", "", WEATHER),), "auto")
    text = tok.decode(tok.render_chat(HISTORY, tools), skip_special_tokens=False)
    assert text.startswith("[tool get_weather]<|im_start|>user")
    assert "[get_weather Paris]" in text and '{"temp": 21}(call_1)' in text


# -- request checks --------------------------------------------------------------------------


def _tool(name: str, parameters: object = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": NAMED_NOPE}, "tool_choice: function 'nope' is not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice='sometimes': must be"),
        ({"tool_choice": {"type": "function"}}, "tool_choice: expected a string or"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]: expected"),
        ({"tools": "get_weather"}, "tools: expected a list"),
        ({"tools": [_tool("a b")]}, "tools[0].function.name='a b'"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name='get_weather': named twice"),
        ({"tools": [_tool("f", {"type": "string"})]}, "tools[0].function.parameters.type="),
        ({"tools": [_tool("f", [])]}, "tools[0].function.parameters: expected"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls: expected a boolean"),
        ({"tool_choice": "required", "tools": []}, "tool_choice='required': needs tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice='required' already constrains",
        ),
    ],
)
def test_bad_tool_fields_are_refused_by_name(extra: dict[str, Any], message: str) -> None:
    body = {"messages": HELLO, "tools": TOOLS, **extra}
    with pytest.raises(InvalidInputError) as info:
        parse_request("chat", body, "r")
    assert str(info.value).startswith(message), str(info.value)


def test_history_tool_fields_are_checked() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    body = {"messages": [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]}]}
    with pytest.raises(
        InvalidInputError, match=r"messages\[1\].tool_calls\[0\].function.arguments"
    ):
        parse_request("chat", body, "r")
    body = {"messages": [*HELLO, {"role": "tool", "content": "21"}]}
    with pytest.raises(InvalidInputError, match=r"messages\[1\].tool_call_id: required"):
        parse_request("chat", body, "r")


def test_tools_are_chat_only_and_parsed_into_the_input() -> None:
    with pytest.raises(InvalidInputError, match=r"^tools: not supported"):
        parse_request("completion", {"prompt": "hi", "tools": TOOLS}, "r")
    body = {"messages": HELLO, "tools": TOOLS, "parallel_tool_calls": False}
    tools = parse_request("chat", body, "r").inputs[0].tools
    assert tools is not None and tools.choice == "auto" and not tools.parallel
    assert parse_request("chat", {"messages": HELLO}, "r").inputs[0].tools is None
    named = {"type": "function", "function": {"name": "get_time"}}
    req = parse_request("chat", {**body, "tool_choice": named}, "r")
    assert req.inputs[0].tools is not None and req.inputs[0].tools.function_name == "get_time"


def test_arguments_of_a_forced_call_validate() -> None:
    # what the grammar lets through, parsed, validates against the schema
    args = '{"city": "Rome", "unit": "celsius"}'
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    (call,) = parse_hermes(text, NAMES)[1]
    jsonschema.validate(_args(call), WEATHER)
