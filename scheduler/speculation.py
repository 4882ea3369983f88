"""When draft tokens pay: a rule learned from the worker's own steps.

A step's time is close to linear in the tokens it computes, ``t(n) = a + b * n``
(scheduler/cost.py fits it from every result). A decode step of ``n`` sequences makes ``n``
tokens in ``a + b * n`` seconds; one more verified draft token costs ``b`` and, when accepted
(probability ``alpha``, learned from results), saves a token's share of a step,
``(a + b * n) / n``. So drafts pay while

    alpha * (a / n + b) > b,   that is   n < alpha * a / ((1 - alpha) * b)

With few sequences the fixed cost ``a`` (reading every weight once) dominates and drafts
are nearly free; as the batch grows the rule turns them off, and back on as it shrinks.
Until the line is known, drafts are tried on small batches only.
"""

from __future__ import annotations

from scheduler.cost import StepCostModel

PRIOR_ACCEPTANCE = 0.5  # until results say otherwise
ACCEPTANCE_DECAY = 0.95  # weight kept per step that verified drafts
SMALL_BATCH = 4  # drafts are tried up to this batch while the step-time line is unknown


class SpeculationPolicy:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens  # the worker's most drafts per sequence; 0: off
        self.cost = StepCostModel(max_stall=1.0, min_chunk=1)
        self.acceptance = PRIOR_ACCEPTANCE
        self.num_draft_tokens = 0  # verified, in total
        self.num_accepted_tokens = 0

    def observe(self, num_tokens: int, seconds: float, drafts: int, accepted: int) -> None:
        """One step's result: tokens computed (drafts included), its time, and its drafts."""
        self.cost.observe(num_tokens, seconds)
        if drafts:
            rate = accepted / drafts
            d = ACCEPTANCE_DECAY
            self.acceptance = self.acceptance * d + rate * (1 - d)
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted

    def drafts_for(self, num_decodes: int) -> int:
        """Draft tokens each decoding sequence may verify in a step of ``num_decodes``."""
        if self.num_tokens == 0 or num_decodes == 0:
            return 0
        fitted = self.cost.fit()
        if fitted is None:
            return self.num_tokens if num_decodes <= SMALL_BATCH else 0
        a, b = fitted
        alpha = min(self.acceptance, 0.99)
        return self.num_tokens if num_decodes * (1 - alpha) * b < alpha * a else 0

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts accepted, over the worker's life (0 before any)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens
