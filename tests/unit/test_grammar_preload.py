"""The worker's grammar tokenizer loads before readiness: loading it holds the GIL for up to
~200 ms at a time, so a worker serving meanwhile stalls its steps (worker/__main__.py waits
on ``Constraints.wait_loaded``)."""

from __future__ import annotations

import threading

from tests.support.tiny_model import build_tokenizer
from worker.engine.constrain import Constraints

EOS = 1


def test_wait_loaded_returns_when_the_preload_ends_and_not_before() -> None:
    tokenizer = build_tokenizer()
    release = threading.Event()

    def slow_load() -> object:
        release.wait(10)
        return tokenizer

    made = Constraints(slow_load, len(tokenizer), [EOS])
    made.preload()
    assert made.wait_loaded(0.05) is False  # still loading: not ready yet
    release.set()
    assert made.wait_loaded(10) is True
    assert made.compiler.tokenizer.vocab_size == len(tokenizer)


def test_a_tokenizer_that_fails_to_load_does_not_hold_readiness() -> None:
    def broken() -> object:
        raise OSError("no tokenizer files next to the weights")

    made = Constraints(broken, 64, [EOS])
    made.preload()
    assert made.wait_loaded(10) is True
