"""A step's masks, filled and unpacked together, on the step thread (few rows) or beside the
forward, are each row's own.

``Constraints.mask`` applies every constrained row's mask in one ``masked_fill``; here its
result is compared with each row masked alone from its matcher's own bitmask, with free rows
between the constrained ones (the gather/scatter path) and with every row constrained (the
direct path), and after tokens consumed by the next step's fill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from canteen.plan import Constraint
from tests.support.tiny_model import build_tokenizer
from worker.engine.constrain import Constraints, GrammarOptions

EOS = 2
CONSTRAINTS = {
    "regex": Constraint("regex", r"[a-z]{2,5}( [a-z]{2,5}){3}\."),
    "json": Constraint(
        "json_schema",
        '{"type":"object","properties":{"n":{"type":"integer"},"s":{"type":"string"}},'
        '"required":["n","s"]}',
    ),
    "choice": Constraint("choice", choices=("alpha beta", "gamma")),
}


@pytest.fixture(params=[16, 0], ids=["on-the-step-thread", "beside-the-forward"])
def constraints(request: pytest.FixtureRequest) -> Constraints:
    tokenizer = build_tokenizer()
    options = GrammarOptions(inline_mask_rows=request.param)
    made = Constraints(lambda: tokenizer, len(tokenizer), [EOS], options)
    for seq_id, constraint in CONSTRAINTS.items():
        made.add(seq_id, constraint, ())
        assert made.settle(seq_id, wait=30) is None
    return made


def _alone(made: Constraints, seq_id: str, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` masked by ``seq_id``'s matcher alone, bit by bit."""
    matcher = made._matchers[seq_id]
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
    return logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))


@pytest.mark.parametrize("free_rows", [True, False])
def test_masks_applied_together_are_each_rows_own(
    constraints: Constraints, free_rows: bool
) -> None:
    torch.manual_seed(0)
    names = list(CONSTRAINTS)
    seq_ids = ["free0", names[0], "free1", names[1], names[2]] if free_rows else names
    for step in range(6):
        logits = torch.randn(len(seq_ids), constraints.vocab_size)
        masks = constraints.begin(seq_ids)
        assert masks is not None
        # three constrained rows: filled on the step thread up to the bound, else beside
        is_beside = constraints.options.inline_mask_rows < 3
        assert (masks.early is not None) == is_beside
        masked = logits.clone()
        constraints.mask(masked, seq_ids, masks)
        for row, seq_id in enumerate(seq_ids):
            want = (
                logits[row]
                if seq_id.startswith("free")
                else _alone(constraints, seq_id, logits[row])
            )
            assert torch.equal(masked[row], want), (step, seq_id)
        # each constrained row takes its best allowed token, consumed at the next step's fill
        picks = [(s, int(masked[r].argmax())) for r, s in enumerate(seq_ids)]
        constraints.advance(picks)
        constraints.finish(masks)


def test_a_constraint_built_before_is_ready_at_once(constraints: Constraints) -> None:
    """A sequence whose grammar this worker built before takes a copy at arrival: no
    compile to wait for, so its first step never defers it."""
    constraints.add("again", CONSTRAINTS["json"], ())
    assert not constraints.failure("again") and not constraints.is_pending("again")
    masks = constraints.begin(["again"])
    assert masks is not None
    logits = torch.zeros(1, constraints.vocab_size)
    constraints.mask(logits, ["again"], masks)
    assert torch.equal(logits[0], _alone(constraints, "again", torch.zeros(constraints.vocab_size)))
    constraints.finish(masks)
