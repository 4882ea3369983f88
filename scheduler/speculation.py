"""When draft tokens pay: a rule learned from the worker's own decode steps.

Whether verifying drafts speeds a step up depends on the batch (a step's fixed cost, reading
every weight once, dominates a small batch and hides the extra tokens; a big batch is
compute-bound and pays for each), on how often drafts hold, and on what proposing costs (free
for n-gram lookup, several forwards of a draft model). So the rule measures the one figure
that matters: tokens made per second of decode-only steps, with and without drafts, per batch
size (in powers of two). Each step takes the better of the two for its batch size; an arm not
yet measured is tried first, and every ``EXPLORE_EVERY``-th step of a batch size tries the
other one, so the rule follows the load and the text: drafts turn off as the batch grows
past where they pay and back on as it shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps of a batch size between tries of the arm that looks worse
RATE_DECAY = 0.8  # weight an arm's estimate keeps per new measurement of it


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # drafts on/off -> tokens/s
    steps: int = 0


class SpeculationPolicy:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens  # the worker's most drafts per sequence; 0: off
        self.num_draft_tokens = 0  # verified, in total
        self.num_accepted_tokens = 0
        self._buckets: dict[int, _Bucket] = {}

    def observe(
        self, num_decodes: int, drafted: bool, made: int, seconds: float, drafts: int, accepted: int
    ) -> None:
        """A decode-only step of ``num_decodes`` sequences (0 for any other step): whether it
        verified drafts, the tokens it made and its time, and its draft counts."""
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        if num_decodes <= 0 or seconds <= 0 or self.num_tokens == 0:
            return
        bucket = self._buckets.setdefault(num_decodes.bit_length(), _Bucket())
        rate = made / seconds
        old = bucket.rate.get(drafted)
        bucket.rate[drafted] = rate if old is None else old * RATE_DECAY + rate * (1 - RATE_DECAY)

    def drafts_for(self, num_decodes: int) -> int:
        """Draft tokens each decoding sequence may verify in a step of ``num_decodes``."""
        if self.num_tokens == 0 or num_decodes == 0:
            return 0
        bucket = self._buckets.setdefault(num_decodes.bit_length(), _Bucket())
        bucket.steps += 1
        on, off = bucket.rate.get(True), bucket.rate.get(False)
        if on is None or off is None:
            use = on is None  # measure the arm not seen yet
        else:
            use = on >= off
            if bucket.steps % EXPLORE_EVERY == 0:
                use = not use
        return self.num_tokens if use else 0

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts accepted, over the worker's life (0 before any)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens
