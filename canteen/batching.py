"""The one batch configuration: how a worker's steps are filled, and its defaults.

The scheduler's flags set every field but ``max_batched_tokens``, which each worker sets for
itself (its memory is sized for its largest step) and reports in ``GetInfo``; the scheduler
then drives that worker with this config, that one field replaced. Nothing else holds a
default for these values.
"""

from __future__ import annotations

from dataclasses import dataclass

from canteen.config import require


@dataclass(frozen=True)
class BatchConfig:
    """Budgets and pacing of one worker's steps."""

    max_batched_tokens: int = 2048
    """Most tokens (decode plus prefill) computed in one step (the worker's flag)."""
    max_num_seqs: int = 256
    """Most sequences in the running batch."""
    max_step_stall: float = 1.5
    """While sequences decode that were streaming when the held prompts arrived, a step
    carrying prefill may take at most this many times a decode-only step (learned from step
    timings); 0: only max_batched_tokens bounds it."""
    pipeline_depth: int = 2
    """Plans in flight per worker: 2 sends the next step while the worker computes this one."""
    watermark_blocks: int = 1
    """Free blocks kept back at admission so running sequences can grow."""
    min_prefill_chunk: int = 16
    """Prefill tokens a step with decodes may always carry, so long prompts progress."""

    def __post_init__(self) -> None:
        require(
            self.max_batched_tokens >= 1,
            "max_batched_tokens",
            self.max_batched_tokens,
            "must be >= 1",
        )
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        require(
            self.max_step_stall == 0 or self.max_step_stall >= 1,
            "max_step_stall",
            self.max_step_stall,
            "must be >= 1, or 0 for no bound",
        )
        require(
            self.pipeline_depth in (1, 2), "pipeline_depth", self.pipeline_depth, "must be 1 or 2"
        )
        require(
            self.watermark_blocks >= 0, "watermark_blocks", self.watermark_blocks, "must be >= 0"
        )
        require(
            self.min_prefill_chunk >= 1, "min_prefill_chunk", self.min_prefill_chunk, "must be >= 1"
        )


DEFAULT = BatchConfig()


def field_help(name: str) -> str:
    """The one-line help of a field, from its docstring above (for the services' flags)."""
    return _HELP[name]


_HELP = {
    "max_batched_tokens": "most tokens one step computes (decode plus prefill)",
    "max_num_seqs": "most sequences in one worker's running batch",
    "max_step_stall": (
        "while streams decode that were streaming when the held prompts arrived, a step "
        "carrying prefill may take at most this many times a decode-only step (learned from "
        "step timings); 0: only --max-batched-tokens bounds it"
    ),
    "pipeline_depth": (
        "plans in flight per worker: 2 builds and sends the next step while the worker "
        "computes this one; 1 waits for each result"
    ),
}
