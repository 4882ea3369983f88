"""The one batch configuration: how a worker's steps are filled, and its defaults.

The scheduler's flags set every field but ``max_batched_tokens``, which each worker sets for
itself (its memory is sized for its largest step) and reports in ``GetInfo``; the scheduler
then drives that worker with this config, that one field replaced. Each field is declared
here once, with its default, help text and bound; a service's flag reuses that declaration
through ``flag``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from canteen.config import Bound, at_least, check_bounds, one_of, option


@dataclass(frozen=True)
class BatchConfig:
    """Budgets and pacing of one worker's steps."""

    max_batched_tokens: int = option(
        2048, "most tokens one step computes (decode plus prefill)", at_least(1)
    )
    max_num_seqs: int = option(256, "most sequences in one worker's running batch", at_least(1))
    # 1.4: the cost model holds a chunk step to this many times the median decode-only
    # step (scheduler/cost.py), and the streams' worst gap is that step plus their own
    # delivery's jitter; at 1.5 the quiet Zen 4 saw 2.06-2.07x (bench/kv.py interference)
    max_step_stall: float = option(
        1.4,
        "while streams decode that were streaming when the held prompts arrived, a step "
        "carrying prefill may take at most this many times a decode-only step (learned from "
        "step timings); 0: only --max-batched-tokens bounds it",
        Bound(lambda stall: stall == 0 or stall >= 1, "must be >= 1, or 0 for no bound"),
    )
    pipeline_depth: int = option(
        2,
        "plans in flight per worker: 2 builds and sends the next step while the worker "
        "computes this one; 1 waits for each result",
        one_of(1, 2),
    )
    watermark_blocks: int = option(
        1, "free blocks kept back at admission so running sequences can grow", at_least(0)
    )
    min_prefill_chunk: int = option(
        16,
        "prefill tokens a step with decodes carries while the worker's step cost is not "
        "learned yet; after that max_step_stall sizes chunks (one token at least)",
        at_least(1),
    )

    def __post_init__(self) -> None:
        check_bounds(self)


DEFAULT = BatchConfig()


def flag(name: str) -> Any:
    """BatchConfig's declaration of field ``name`` (default, help text and bound) for the
    service config whose flag sets it, so each exists once."""
    declared = next(field for field in dataclasses.fields(BatchConfig) if field.name == name)
    return dataclasses.field(default=declared.default, metadata=declared.metadata)
