"""Token ids to text as they stream: incremental detokenization and stop strings.

The detokenizer never releases a broken UTF-8 character: while the decoded tail ends in
U+FFFD it waits for the next token. The stop matcher holds back the last few characters that
could still be the start of a stop string, so a stop string split across tokens is never
partly streamed.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids before this have been released as text

    def push(self, ids: list[int] | tuple[int, ...]) -> str:
        self._ids.extend(ids)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if not final and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta


class StopMatcher:
    """Finds the first stop string in the streamed text; releases only text that is safe."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.is_stopped = False

    def push(self, text: str) -> str:
        if self.is_stopped:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.is_stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.is_stopped else out
