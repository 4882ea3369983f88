"""Speculative decoding on the real model: a paragraph to repeat gives drafts that hold, and
the answer is token for token the one without speculation."""

from __future__ import annotations

import urllib.request

import pytest

from canteen.v1 import inference_pb2
from tests.e2e.conftest import SmolSuite

pytestmark = pytest.mark.e2e

PARAGRAPH = (
    "Canteen is an inference service. It takes prompts, queues them, batches them on the fly, "
    "runs prefill and decode on the model, manages the KV cache memory, and streams the answer "
    "back token by token, while staying healthy, observable and deployable."
)


def _counter(smol: SmolSuite, name: str) -> float:
    text = urllib.request.urlopen(smol.scheduler.metrics_url, timeout=5).read().decode()
    prefix = f"canteen_speculative_{name}_tokens_total"
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(prefix))


def _accepted(smol: SmolSuite) -> float:
    return _counter(smol, "accepted")


def test_a_repeated_paragraph_is_the_same_with_drafts_and_they_are_accepted(
    smol: SmolSuite,
) -> None:
    def ask(disable: bool) -> list[int]:
        req = inference_pb2.GenerateRequest(
            max_tokens=64, temperature=0, disable_speculation=disable
        )
        req.messages.messages.add(
            role="user", content=f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"
        )
        return list(smol.inference.Complete(req, timeout=300).token_ids)

    before, verified = _accepted(smol), _counter(smol, "draft")
    with_drafts = ask(False)
    drafts = f"{_counter(smol, 'draft') - verified} verified (before: {verified})"
    # most of a repeated paragraph comes from drafts
    assert _accepted(smol) - before >= 16, f"accepted {_accepted(smol) - before}, {drafts}"
    assert with_drafts == ask(True)
