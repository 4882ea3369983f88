"""LoRA adapters in a worker's batch: which waiting sequences may join it under the
worker's --max-loras, and which worker already holds an adapter (routing prefers it).

A worker computes a step's tokens with at most ``max_loras`` distinct adapters. The limit is
kept at admission, as vLLM does: the running batch never mixes more than ``max_loras``
adapters, so no step can; a sequence of another adapter waits until one leaves the batch.

Admission counts an adapter's load as work: a sequence whose adapter the worker holds
neither loaded nor for the running batch takes ADAPTER_LOAD_TOKENS of the step's token
budget on top of its prompt chunk, so a step that loads an adapter admits less prefill
beside it and stays about as long as the steps around it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from scheduler.sequence import Sequence

if TYPE_CHECKING:
    from scheduler.batcher import BatchScheduler

# Prompt tokens one adapter load weighs as: reading a few-MB PEFT file and checking its
# digest takes a CPU worker about as long as prefilling a few dozen tokens of a small model.
ADAPTER_LOAD_TOKENS = 32


def admissible_waiting(
    waiting: list[Sequence], running: Iterable[Sequence], max_loras: int | None
) -> list[Sequence]:
    """The waiting sequences that may join ``running`` without it mixing more than
    ``max_loras`` adapters (None: no limit). The base model takes no adapter slot."""
    if max_loras is None:
        return waiting
    active = {s.adapter_id for s in running if s.adapter is not None}
    if len(active) < max_loras:
        return waiting
    return [s for s in waiting if s.adapter is None or s.adapter_id in active]


def holds_adapter(core: BatchScheduler, adapter_id: str) -> bool:
    """Whether the worker holds the adapter loaded (its last report), or will for work
    already queued or running on it."""
    return adapter_id in core.resident_adapters or any(
        s.adapter_id == adapter_id for s in (*core.running, *core.waiting)
    )


def adapter_load_tokens(
    seq: Sequence, resident: frozenset[str], running: Iterable[Sequence]
) -> int:
    """The step budget ``seq``'s admission takes for loading its adapter: none for the
    base model, or an adapter loaded or used by the running batch already."""
    if seq.adapter is None or seq.adapter_id in resident:
        return 0
    if any(s.adapter_id == seq.adapter_id for s in running):
        return 0
    return ADAPTER_LOAD_TOKENS
