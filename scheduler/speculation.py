"""When draft tokens pay: a rule learned from the worker's own decode steps and from each
sequence's own drafts.

A drafting step of B decoding sequences costs ``t_on`` seconds (verifying the drafts, and a
draft model's forwards); a plain step costs ``t_off``. Both are wall times between results,
so a step the worker had to wait for (no plan in flight behind it) counts its wait. Plain
steps make B tokens; drafting steps make B plus the drafts that held. So drafts pay when the
sequences' expected accepted drafts per step, averaged over the batch, exceed
``t_on / t_off - 1``: the break-even, which grows with the batch (a small batch is bound by
reading the weights and hides the extra rows; a big one pays for each).

The two figures come apart, and each is learned where it lives:
- step times depend on the batch, the worker and the drafter, not on the text: measured per
  batch size (in powers of two), each arm's cost the quickest of its last ``TIME_WINDOW``
  steps. A shared host only ever adds time to a step (a neighbour, a collection, the edge
  services on the same cores), so the quickest recent step is the arm's cost, and one slow
  step (CI once measured a drafting step at 6x a plain one, after which a moving average
  kept a paragraph-repeating stream from drafting for the rest of its answer) costs nothing
  once a normal one follows. A drafting step whose drafter proposed nothing is no
  measurement of drafts: it costs what a plain step costs;
- how many drafts hold depends on the text: each sequence keeps its own moving average of
  the drafts accepted per drafting step (``DraftRecord``). One never measured counts as if
  ``PRIOR_SHARE`` of its drafts held, so a new request gets a few drafting steps to show
  what its text does, whatever the requests before it did (where even that would not pay,
  it gets none: a draft model's drafting steps in a big batch cost several plain ones).

Each step takes the better arm for its batch size. Both step times are first measured
(without drafts first); then, after ``EXPLORE_EVERY`` steps, the arm that looks worse is
tried until a step of it has been measured (with plans sent ahead, that step's result
arrives a step or two after it was planned; the try refreshes every sequence's record too),
and after twice as many each time it still looks worse (up to ``MAX_EXPLORE_EVERY``).
Drafts are not tried again where they could not pay even if every one held (a draft model's
drafting step in a batch of 16 costs a dozen plain ones: one try would cost more than it
could ever win), once ``MIN_MEASURED`` drafting steps there have said so: one slow step
alone does not. Drafts are not tried at a batch size when the batch's expected acceptance
is below a smaller size's break-even (a bigger batch's break-even is higher), nor, above
``FREE_TRY_SIZE``, before the next smaller size has shown that they pay: a busy server that
starts at 16 sequences and drains through 8, 4 and 2 would otherwise pay a measuring try at
each size, each costing several plain steps where a draft model runs. The first step after
a switch is not measured: turning drafts on costs a draft model with a pool of its own its
catch-up on every sequence, once, not per step. So drafts turn off as the batch grows past
where they pay, and back on as it shrinks or as a request whose drafts hold arrives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from canteen.logging import get_logger

log = get_logger(__name__)

EXPLORE_EVERY = 16  # steps of a batch size before the arm that looks worse is tried again
MAX_EXPLORE_EVERY = 512
TRY_STEPS = 2  # fewest steps in a row of a tried arm (the first, the switch, is not measured)
# most steps of a try: its measured step's result comes back a pipeline depth after its plan,
# or never where the batch changes size in between
MAX_TRY_STEPS = 6
TIME_WINDOW = 4  # an arm's cost: the quickest of its last this many measured steps
# weight a sequence's acceptance keeps per drafting step: with drafts that hold 93% of the
# time, one step in 14 accepts none, and a shorter memory took that one step for a change of
# text and turned drafts off for the next EXPLORE_EVERY steps
RECORD_DECAY = 0.8
PRIOR_SHARE = 0.75  # a sequence never measured: this share of its drafts expected to hold
FREE_TRY_SIZE = 2  # size buckets (1, 2-3 sequences) where drafts are tried unproven
# Drafting steps measured at a batch size before "drafts could not pay here even if every one
# held" stops the tries there, judged by the quickest of them: slow first steps (a busy host
# while the suite warms up) measured 6x a plain step and kept a stream that repeats a
# paragraph from ever drafting again.
MIN_MEASURED = 3


@dataclass
class DraftRecord:
    """One sequence's drafts: how many held per drafting step, lately (None: never tried)."""

    accepted: float | None = None

    def observe(self, accepted: int) -> None:
        old = self.accepted
        self.accepted = (
            accepted if old is None else old * RECORD_DECAY + accepted * (1 - RECORD_DECAY)
        )


@dataclass
class _Bucket:
    recent: dict[bool, deque[float]] = field(default_factory=dict)  # arm -> last step times
    steps: int = 0  # since the last try of the worse arm
    explore_every: int = EXPLORE_EVERY
    trying: bool | None = None  # the arm being tried
    tried: int = 0  # steps of the try so far
    measured_before: int = 0  # the tried arm's measured steps when the try began
    last: bool | None = None  # the arm of the last measured step
    chosen: bool | None = None  # the arm the last plan took (logged at debug when it changes)
    measured: dict[bool, int] = field(default_factory=dict)  # steps measured per arm
    fastest: dict[bool, float] = field(default_factory=dict)  # quickest step per arm
    gave_up: bool = False  # drafts found unable to pay here (logged once)

    @property
    def seconds(self) -> dict[bool, float]:
        """Each measured arm's step time: the quickest of its recent steps."""
        return {arm: min(times) for arm, times in self.recent.items()}

    def record(self, arm: bool, seconds: float) -> None:
        self.recent.setdefault(arm, deque(maxlen=TIME_WINDOW)).append(seconds)
        self.measured[arm] = self.measured.get(arm, 0) + 1
        self.fastest[arm] = min(self.fastest.get(arm, seconds), seconds)

    def start_try(self, arm: bool) -> bool:
        self.trying, self.steps, self.tried = arm, 0, 1
        self.measured_before = self.measured.get(arm, 0)
        return arm

    def try_goes_on(self) -> bool:
        """Whether the try needs another step: fewer than TRY_STEPS so far, or none of its
        steps measured yet (up to MAX_TRY_STEPS)."""
        assert self.trying is not None
        unmeasured = self.measured.get(self.trying, 0) == self.measured_before
        if self.tried < TRY_STEPS or (unmeasured and self.tried < MAX_TRY_STEPS):
            self.tried += 1
            return True
        return False

    def judge_try(self, best: bool) -> None:
        """The try is over: retry sooner if the tried arm now looks best, later if not."""
        arm, self.trying = self.trying, None
        lost = arm != best
        self.explore_every = (
            min(self.explore_every * 2, MAX_EXPLORE_EVERY) if lost else EXPLORE_EVERY
        )

    @property
    def break_even(self) -> float | None:
        """Accepted drafts per sequence and step at which drafting steps pay for themselves."""
        seconds = self.seconds
        on, off = seconds.get(True), seconds.get(False)
        return None if on is None or off is None else on / off - 1


class SpeculationPolicy:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens  # the worker's most drafts per sequence; 0: off
        self.num_draft_tokens = 0  # verified, in total
        self.num_accepted_tokens = 0
        self._buckets: dict[int, _Bucket] = {}

    def observe(
        self, num_decodes: int, drafted: bool, seconds: float, drafts: int, accepted: int
    ) -> None:
        """A decode-only step of ``num_decodes`` sequences (0 for any other step): whether it
        verified drafts, its time, and its draft counts."""
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        if num_decodes <= 0 or seconds <= 0 or self.num_tokens == 0:
            return
        bucket = self._buckets.setdefault(num_decodes.bit_length(), _Bucket())
        switched, bucket.last = bucket.last is not None and bucket.last != drafted, drafted
        if switched or (drafted and drafts == 0):
            return  # a switch's cost (a draft model's catch-up) is not the arm's
        bucket.record(drafted, seconds)

    def drafts_for(self, num_decodes: int, records: Iterable[DraftRecord] = ()) -> int:
        """Draft tokens each decoding sequence may verify in a step of ``num_decodes``;
        ``records``: those of the sequences that may verify drafts this step."""
        if self.num_tokens == 0 or num_decodes == 0:
            return 0
        prior = self.num_tokens * PRIOR_SHARE
        gain = sum(prior if r.accepted is None else r.accepted for r in records)
        on = self._choose(num_decodes, gain / num_decodes)
        bucket = self._buckets[num_decodes.bit_length()]
        if on != bucket.chosen:
            bucket.chosen = on
            log.debug(
                "drafts turned " + ("on" if on else "off"),
                batch_size=num_decodes,
                expected_accepted=round(gain / num_decodes, 2),
                break_even=None if bucket.break_even is None else round(bucket.break_even, 2),
                seconds_on=bucket.seconds.get(True),
                seconds_off=bucket.seconds.get(False),
                trying=bucket.trying,
            )
        return self.num_tokens if on else 0

    def _choose(self, num_decodes: int, expected: float) -> bool:
        """Drafts or not for a batch whose sequences expect ``expected`` accepted drafts
        each per drafting step."""
        size = num_decodes.bit_length()
        bucket = self._buckets.setdefault(size, _Bucket())
        need = bucket.break_even
        if bucket.trying is not None:
            if bucket.try_goes_on():
                return bucket.trying
            bucket.judge_try(need is not None and expected > need)
        if bucket.seconds.get(False) is None:
            return bucket.start_try(False)  # measure each arm, the cheap one first
        if need is None:
            return False if self._not_worth_a_try(size, expected) else bucket.start_try(True)
        best = expected > need
        bucket.steps += 1
        if bucket.steps >= bucket.explore_every:
            hopeless = bucket.measured.get(True, 0) >= MIN_MEASURED and self.num_tokens <= (
                bucket.fastest[True] / bucket.seconds[False] - 1
            )  # even the quickest drafting step measured here: early steps can all be slow
            if not best and (hopeless or self._not_worth_a_try(size, expected)):
                bucket.steps = 0  # drafts could not pay here even if every one held
                if hopeless and not bucket.gave_up:
                    bucket.gave_up = True  # logged once per batch size
                    log.info(
                        "drafts stay off: they could not pay even if every one held",
                        batch_size=num_decodes,
                        break_even=round(need, 2),
                        seconds_on=bucket.seconds.get(True),
                        seconds_off=bucket.seconds.get(False),
                    )
                return False
            return bucket.start_try(not best)
        return best

    def _not_worth_a_try(self, size: int, expected: float) -> bool:
        """Drafts would lose at a smaller batch size with this acceptance (a bigger batch's
        break-even is higher), or, above FREE_TRY_SIZE, the next smaller size has not shown
        that they pay: either way trying them here is not worth its cost. Drafts climb one
        size at a time, so a worker whose single streams draft well does not try them at
        16 sequences before 8 have shown they pay there too."""
        for smaller, bucket in self._buckets.items():
            need = bucket.break_even
            if smaller < size and need is not None and expected <= need:
                return True
        below = self._buckets.get(size - 1)
        need = None if below is None else below.break_even
        return size > FREE_TRY_SIZE and (need is None or expected <= need)

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts accepted, over the worker's life (0 before any)."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens
