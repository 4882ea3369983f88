"""Which draft tokens a step verifies (--speculative): the runner's part of speculation.

Proposals come by prompt lookup (worker/speculation/speculate.py) or from a draft model
(worker/speculation/draft.py); these functions decide how many each sequence may verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from canteen.plan import Sampling, ScheduledSequence
from worker.speculation.draft import DraftModel, DraftRequest
from worker.speculation.speculate import SpeculationConfig, propose_ngram


class Drafting(Protocol):
    """What a sequence's state offers the functions below (the runner's SequenceState)."""

    seq_id: str
    tokens: list[int]
    sampling: Sampling
    block_ids: list[int]
    num_computed: int


def draft_limit(
    seq: Drafting,
    item: ScheduledSequence,
    spec: SpeculationConfig,
    block_size: int,
    max_model_len: int,
) -> int:
    """Drafts ``item`` may verify: only where the scheduler granted them, the sequence
    samples this step, is unconstrained, and its blocks have room."""
    end = seq.num_computed + item.num_tokens
    if not item.num_draft_tokens or end != len(seq.tokens):
        return 0
    if seq.sampling.constraint is not None:
        return 0  # each draft would need the grammar's state after the one before
    room = len(seq.block_ids) * block_size - end
    return max(min(item.num_draft_tokens, spec.num_tokens, room, max_model_len - end - 1), 0)


def propose(
    wanted: Sequence[tuple[Drafting, int]], spec: SpeculationConfig, draft: DraftModel | None
) -> dict[str, list[int]]:
    """Draft tokens per sequence of ``wanted`` (each with its limit), by prompt lookup or
    from the draft model."""
    asked = [(seq, k) for seq, k in wanted if k > 0]
    if draft is not None:
        requests = [
            DraftRequest(s.seq_id, s.tokens, s.block_ids, k, s.num_computed) for s, k in asked
        ]
        return draft.propose(requests)
    return {
        seq.seq_id: propose_ngram(seq.tokens, k, spec.max_ngram, spec.min_ngram) for seq, k in asked
    }
