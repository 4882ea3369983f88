"""What one benchmark request asks for and what was measured while it ran."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    prompt: str
    """The prompt text, sent as a raw prompt (no chat template)."""
    max_tokens: int
    """Tokens to generate; sent with ignore_eos so the answer has exactly this many."""
    prompt_len: int = 0
    """The prompt length in tokens the dataset aimed for (0: unknown, e.g. jsonl)."""


@dataclass
class RequestRecord:
    """The timings and token counts of one request; times are seconds."""

    index: int
    """Position of the request in the workload."""
    max_tokens: int
    """The requested output length."""
    prompt_len: int = 0
    """The prompt length in tokens the dataset aimed for (0: unknown)."""
    start: float = 0.0
    """When it was sent, seconds after the run started."""
    ttft: float | None = None
    """Time to the first token-bearing message."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive token-bearing messages."""
    e2e: float | None = None
    """End-to-end latency; None when the request failed."""
    prompt_tokens: int = 0
    """Prompt tokens, as the server reported in usage."""
    completion_tokens: int = 0
    """Completion tokens, as the server reported in usage."""
    error: str | None = None
    """gRPC status code name, ``HTTP <status>``, or an exception name; None on success."""
    detail: str = ""
    """The error message, shortened."""

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (completion_tokens - 1)."""
        return time_per_output_token(self.e2e, self.ttft, self.completion_tokens)


def time_per_output_token(
    e2e: float | None, ttft: float | None, completion_tokens: int
) -> float | None:
    if e2e is None or ttft is None or completion_tokens <= 1:
        return None
    return (e2e - ttft) / (completion_tokens - 1)
