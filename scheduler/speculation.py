"""When draft tokens pay: a rule learned from the worker's own decode steps.

Whether verifying drafts speeds a step up depends on the batch (a step's fixed cost, reading
every weight once, dominates a small batch and hides the extra tokens; a big batch is
compute-bound and pays for each), on how often drafts hold, and on what proposing costs (free
for n-gram lookup, several forwards of a draft model). So the rule measures the one figure
that matters: tokens made per second of decode-only steps, with and without drafts, per batch
size (in powers of two). Each step takes the better of the two for its batch size. Both arms
are measured once first (without drafts first: trying drafts costs a draft model its
catch-up on every sequence), then the worse one is tried again after ``EXPLORE_EVERY``
steps, and after twice as many each time that try confirms it is worse (up to
``MAX_EXPLORE_EVERY``), so the rule follows the load and the text at little cost: drafts turn
off as the batch grows past where they pay and back on as it shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps of a batch size before the arm that looks worse is tried again
MAX_EXPLORE_EVERY = 512
RATE_DECAY = 0.8  # weight an arm's estimate keeps per new measurement of it


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # drafts on/off -> tokens/s
    steps: int = 0  # since the last try of the worse arm
    explore_every: int = EXPLORE_EVERY
    exploring: bool | None = None  # the arm being tried, until its result comes back


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
        if bucket.exploring is not None and bucket.exploring == drafted:
            still_worse = bucket.rate[drafted] < bucket.rate.get(not drafted, 0.0)
            grown = min(bucket.explore_every * 2, MAX_EXPLORE_EVERY)
            bucket.explore_every = grown if still_worse else EXPLORE_EVERY
            bucket.exploring = None

    def drafts_for(self, num_decodes: int) -> int:
        """Draft tokens each decoding sequence may verify in a step of ``num_decodes``."""
        if self.num_tokens == 0 or num_decodes == 0:
            return 0
        bucket = self._buckets.setdefault(num_decodes.bit_length(), _Bucket())
        on, off = bucket.rate.get(True), bucket.rate.get(False)
        if off is None:
            use = False  # measure each arm once, the cheap one first
        elif on is None:
            use = True
        else:
            use = on >= off
            bucket.steps += 1
            if bucket.steps > 2 * bucket.explore_every:
                bucket.exploring = None  # that try never came back as a decode-only step
            if bucket.steps >= bucket.explore_every and bucket.exploring is None:
                bucket.steps, bucket.exploring = 0, not use
                use = not use
        return self.num_tokens if use else 0

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts accepted, over the worker's life (0 before any)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens
