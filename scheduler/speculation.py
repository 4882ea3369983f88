"""When draft tokens pay: a rule learned from the worker's own decode steps.

Whether verifying drafts speeds a step up depends on the batch (a step's fixed cost, reading
every weight once, dominates a small batch and hides the extra tokens; a big batch is
compute-bound and pays for each), on how often drafts hold, and on what proposing costs (free
for n-gram lookup, several forwards of a draft model). So the rule measures the one figure
that matters: tokens made per second of decode-only steps, with and without drafts, per batch
size (in powers of two). A drafting step's seconds include the round trip before it (the
batcher builds no plan on top of one, so the worker waits for it); a step without drafts is
pipelined and costs only its own time.

Each step takes the better of the two for its batch size. Both arms are first measured
(without drafts first), then the worse one is tried again for a few steps after
``EXPLORE_EVERY`` steps, and after twice as many each time it loses again (up to
``MAX_EXPLORE_EVERY``). Drafts are not tried at a batch size while they lose at a smaller one:
each verified token costs a bigger batch more, so they would lose there too. The first step
after a switch is not measured: turning drafts on costs a draft model with a pool of its own
its catch-up on every sequence, once, not per step. So the rule follows the load and the text
at little cost: drafts turn off as the batch grows past where they pay and back on as it
shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps of a batch size before the arm that looks worse is tried again
MAX_EXPLORE_EVERY = 512
TRY_STEPS = 3  # steps in a row of a tried arm (the first, the switch, is not measured)
RATE_DECAY = 0.7  # weight an arm's estimate keeps per new measurement of it


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # drafts on/off -> tokens/s
    steps: int = 0  # since the last try of the worse arm
    explore_every: int = EXPLORE_EVERY
    trying: bool | None = None  # the arm being tried, for ``left`` more steps
    left: int = 0
    last: bool | None = None  # the arm of the last measured step

    def start_try(self, arm: bool) -> bool:
        self.trying, self.left, self.steps = arm, TRY_STEPS - 1, 0
        return arm

    def judge_try(self) -> None:
        """The try is over: retry sooner if the tried arm won, later if it lost again."""
        arm, self.trying = self.trying, None
        if arm is None or None in (self.rate.get(True), self.rate.get(False)):
            return
        lost = self.rate[arm] < self.rate[not arm]
        self.explore_every = (
            min(self.explore_every * 2, MAX_EXPLORE_EVERY) if lost else EXPLORE_EVERY
        )


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
        switched, bucket.last = bucket.last is not None and bucket.last != drafted, drafted
        if switched:
            return  # a switch's cost (a draft model's catch-up) is not the arm's
        rate = made / seconds
        old = bucket.rate.get(drafted)
        bucket.rate[drafted] = rate if old is None else old * RATE_DECAY + rate * (1 - RATE_DECAY)

    def drafts_for(self, num_decodes: int) -> int:
        """Draft tokens each decoding sequence may verify in a step of ``num_decodes``."""
        if self.num_tokens == 0 or num_decodes == 0:
            return 0
        return self.num_tokens if self._choose(num_decodes) else 0

    def _choose(self, num_decodes: int) -> bool:
        size = num_decodes.bit_length()
        bucket = self._buckets.setdefault(size, _Bucket())
        if bucket.trying is not None:
            if bucket.left > 0:
                bucket.left -= 1
                return bucket.trying
            bucket.judge_try()
        on, off = bucket.rate.get(True), bucket.rate.get(False)
        if off is None:
            return bucket.start_try(False)  # measure each arm, the cheap one first
        if on is None:
            return False if self._lose_below(size) else bucket.start_try(True)
        best = on >= off
        bucket.steps += 1
        if bucket.steps >= bucket.explore_every:
            if not best and self._lose_below(size):
                bucket.steps = 0
                return False
            return bucket.start_try(not best)
        return best

    def _lose_below(self, size: int) -> bool:
        """Drafts lose at a smaller batch size now: a bigger batch pays more per verified
        token, so they would lose here too, and trying them here is not worth its cost."""
        for smaller, bucket in self._buckets.items():
            on, off = bucket.rate.get(True), bucket.rate.get(False)
            if smaller < size and on is not None and off is not None and on < off:
                return True
        return False

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts accepted, over the worker's life (0 before any)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens
