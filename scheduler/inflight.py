"""The plans in flight, as the batcher (scheduler/batcher.py) sees its sequences through them.

With pipelining, a plan is built while earlier ones are still being computed. Each plan keeps
one ``Entry`` per sequence as it was sent; ``InFlightSums`` adds them up per sequence, so the
next plan sees each sequence as it will be once the plans in flight come back (``Ahead``).
The sums live here, in the batcher's plan records, not on the sequence.

Pipelining: with ``depth`` 2 the next plan is built and sent while the worker computes the
previous one, so the worker never waits for a round trip. A plan assumes the plans in flight
come back as sent: a sequence whose last known token is being sampled is scheduled for its
next decode already (the worker appends the sampled token itself). One that then turns out
to have stopped (EOS, a stop token) costs one wasted token and is dropped a step later;
``max_tokens`` is known ahead, so no plan computes past it. The worker runs plans strictly in
order, so blocks freed now may go to the next plan even while an earlier one is in flight.
Results of a plan apply only to sequences still in the incarnation it was sent to.

A plan that verifies drafts makes between one and drafts + 1 tokens a sequence, so the plan
built on top of it assumes the most: its blocks and its drafts' room cover every draft in
flight holding, and a sequence that would be done if they all held waits for the result. The
worker computes "the sequence's next token" whatever came before, so the plan is right for
any outcome; reserved blocks that the drafts did not fill serve the sequence's later tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sequence import Sequence, Status

# Values, never changed once made; slotted and not frozen because the batcher makes several
# per sequence per step, and a frozen dataclass costs several times as much to build.


@dataclass(slots=True)
class Entry:
    """One sequence of a plan in flight, as it was when the plan was sent."""

    seq: Sequence
    incarnation: int
    num_tokens: int
    samples: bool
    drafts: int = 0  # draft tokens granted: its result may carry up to drafts + 1 tokens

    @property
    def is_current(self) -> bool:
        return self.seq.status is Status.RUNNING and self.seq.incarnation == self.incarnation


@dataclass(slots=True)
class InFlight:
    """One sequence's entries in the plans in flight, summed: what they will compute and
    sample for it if they come back as sent."""

    num_tokens: int = 0
    num_samples: int = 0
    num_drafts: int = 0  # draft tokens granted: each may hold or not


NOTHING_IN_FLIGHT = InFlight()


@dataclass(slots=True)
class Ahead:
    """A sequence as the next plan sees it, assuming the plans in flight come back."""

    seq: Sequence
    plans: InFlight

    @property
    def num_scheduled(self) -> int:
        """Tokens computed, or being computed by a plan in flight."""
        return self.seq.num_computed + self.plans.num_tokens

    @property
    def num_unscheduled(self) -> int:
        """Tokens known once the plans in flight return that no plan computes yet."""
        return self.seq.num_tokens + self.plans.num_samples - self.num_scheduled

    @property
    def is_decoding(self) -> bool:
        """Past its prompt once the plans in flight return: one token a step."""
        has_output = bool(self.seq.output_ids) or self.plans.num_samples > 0
        return has_output and self.num_unscheduled == 1

    @property
    def num_samples_at_most(self) -> int:
        """Tokens the plans in flight sample if every draft in them holds."""
        return self.plans.num_samples + self.plans.num_drafts

    @property
    def num_scheduled_at_most(self) -> int:
        """``num_scheduled`` if every draft in flight holds: what its blocks must cover."""
        return self.num_scheduled + self.plans.num_drafts


class InFlightSums:
    """Every sequence's entries in the plans in flight, summed, by sequence id."""

    def __init__(self) -> None:
        self._sums: dict[str, InFlight] = {}

    def ahead(self, seq: Sequence) -> Ahead:
        return Ahead(seq, self._sums.get(seq.seq_id, NOTHING_IN_FLIGHT))

    def count(self, entry: Entry, sign: int) -> None:
        """Adds a plan's entry to its sequence's sums (sign 1: sent), or takes it back
        (sign -1: answered)."""
        was = self._sums.get(entry.seq.seq_id, NOTHING_IN_FLIGHT)
        self._sums[entry.seq.seq_id] = InFlight(
            was.num_tokens + sign * entry.num_tokens,
            was.num_samples + sign * entry.samples,
            was.num_drafts + sign * entry.drafts,
        )

    def forget(self, seq_id: str) -> None:
        """Results of plans sent before now no longer apply to this sequence."""
        self._sums.pop(seq_id, None)

    def clear(self) -> None:
        self._sums.clear()
