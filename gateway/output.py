"""What the gateway makes of the scheduler's responses for one request: UTF-8-safe text
ending at the first stop string or where the content screen cuts it, why it ended, and the
request's usage. ``Output`` is the one place usage is decided in the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from canteen.finish import Finish, finish_from_pb
from canteen.logging import get_logger
from canteen.v1 import common_pb2
from gateway.screen import Screen, StreamScreen
from gateway.text import IncrementalDetokenizer, StopMatcher
from gateway.tokenizers import Tokenizer
from gateway.tool_parsers import ToolStream
from gateway.tools import ToolCall
from gateway.upstream_connect import Response

log = get_logger(__name__)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def request_usage(choices: Sequence[Usage]) -> Usage:
    """One request's usage over its choices, in choice order: completion tokens add up;
    prompt and cached tokens are choice 0's (every choice has the same prompt). Streamed
    and whole answers both report this, whatever order the choices finished in."""
    if not choices:
        return Usage()
    first = choices[0]
    return Usage(
        first.prompt_tokens, sum(c.completion_tokens for c in choices), first.cached_tokens
    )


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    model: str
    finish_reason: Finish | None = None
    usage: Usage | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # on the last delta only


class Output:
    """One request's responses turned into deltas; the last carries finish and usage."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        screen: Screen | None,
        model_ref: str,
        num_prompt_tokens: int,
    ) -> None:
        self._detok, self._stops = IncrementalDetokenizer(tokenizer), StopMatcher(stop)
        self._has_stops = any(stop)
        self._screen = StreamScreen(screen) if screen is not None else None
        self._model_ref = model_ref
        self._num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0  # every token received, shown or not

    def push(self, msg: Response) -> TextDelta:
        """The delta for ``msg``; finish_reason is set when the stream ends with it."""
        ids = list(msg.token_ids)  # each protobuf field read once: reads cost on this path
        kept, text = self._text_of(ids)
        self.num_tokens += kept
        delta = _delta(msg, ids, text, self._model_ref, kept)
        finish = finish_from_pb(msg.finish_reason) if msg.finish_reason else None
        if finish is not None and not self._stops.is_stopped:
            rest = self._detok.flush()
            delta.text += self._stops.push(rest) + self._stops.flush() if self._has_stops else rest
        if self._screen is not None and self._screen.push(delta.text) is not None:
            log.info("output cut by the content screen", reason=self._screen.reason)
            # Nothing of the cut text leaves: no text, no token ids, no logprobs.
            delta.text, delta.token_ids, delta.logprobs, delta.top_logprobs = "", [], [], []
            return self._end(delta, Finish.CONTENT_FILTER, None)
        if self._stops.is_stopped:
            return self._end(delta, Finish.STOP, None)
        if finish is not None:
            return self._end(delta, finish, msg.usage)
        return delta

    def _text_of(self, ids: list[int]) -> tuple[int, str]:
        """The text ``ids`` release, and how many of them count: a message of several
        tokens (a stream interval) is matched token by token against the stop strings, so
        that the tokens after the one that completed a stop string are dropped, exactly as
        when each token came alone."""
        if not self._has_stops:
            return len(ids), self._detok.push(ids)
        if len(ids) <= 1:
            return len(ids), self._stops.push(self._detok.push(ids))
        text = ""
        for i, token in enumerate(ids):
            text += self._stops.push(self._detok.push((token,)))
            if self._stops.is_stopped:
                return i + 1, text
        return len(ids), text

    def _end(self, delta: TextDelta, finish: Finish, counted: common_pb2.Usage | None) -> TextDelta:
        """``delta`` as the last, with the request's usage: the scheduler's count when it
        ended the sequence; when the gateway cut it (a stop string, the screen), the prompt
        and every token received, none reported as cached."""
        delta.finish_reason = finish
        if counted is not None:
            delta.usage = Usage(
                counted.prompt_tokens, counted.completion_tokens, counted.cached_tokens
            )
        else:
            delta.usage = Usage(self._num_prompt_tokens, self.num_tokens, 0)
        return delta


async def with_tool_calls(
    deltas: AsyncIterator[TextDelta], split: ToolStream
) -> AsyncIterator[TextDelta]:
    """The deltas with call text held back: the last one carries the parsed calls, and
    finish TOOL_CALLS when the model ended its answer with them."""
    async for delta in deltas:
        delta.text = split.push(delta.text)
        if delta.finish_reason is not None:
            rest, delta.tool_calls = split.finish()
            delta.text += rest
            if delta.tool_calls and delta.finish_reason is Finish.STOP:
                delta.finish_reason = Finish.TOOL_CALLS
        yield delta


def _delta(msg: Response, ids: list[int], text: str, model_ref: str, kept: int) -> TextDelta:
    """The delta of the first ``kept`` of ``msg``'s tokens ``ids``."""
    delta = TextDelta(text, ids if kept == len(ids) else ids[:kept], model_ref)
    if msg.logprobs:
        delta.logprobs = list(msg.logprobs[:kept])
    if msg.top_logprobs:
        delta.top_logprobs = [
            list(zip(top.token_ids, top.logprobs, strict=True)) for top in msg.top_logprobs[:kept]
        ]
    return delta
