"""The step plan between scheduler and worker, as plain domain objects (no protobuf, no torch).

A new sequence is sent once with its tokens and blocks; later steps name it by id with the
number of tokens to compute and any new blocks. Sampled tokens never travel back to the
worker: it appends them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20  # most alternatives a sequence may ask for per token


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its tokens; the draw at a position depends on (seed, position)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    top_logprobs: int = 0

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflow float32 into inf and NaN probabilities;
        # sampling that cold is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class NewSequence:
    seq_id: str
    token_ids: tuple[int, ...]
    sampling: Sampling
    block_ids: tuple[int, ...]
    num_cached_tokens: int = 0
    traceparent: str = ""  # W3C trace context of the request; empty when untraced


@dataclass(frozen=True)
class ScheduledSequence:
    seq_id: str
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    new_sequences: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledSequence, ...] = ()
    dropped_seq_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def kind(self) -> str:
        """``prefill`` when the step computes any prompt tokens, else ``decode`` (metrics)."""
        has_prefill = self.num_tokens > len(self.scheduled) or bool(self.new_sequences)
        return "prefill" if has_prefill else "decode"


@dataclass(frozen=True)
class SampledToken:
    seq_id: str
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most likely (token, logprob), when asked


@dataclass(frozen=True)
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...] = ()
    num_tokens: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    total_ns: int = 0
