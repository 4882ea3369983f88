"""Turns request records into a run summary: throughput, goodput and latency percentiles."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from canteen.tools.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); ValueError when empty."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile={q}: must be in [0, 100]")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(
            mean=float(np.mean(np.asarray(values, dtype=np.float64))), p50=p50, p90=p90, p99=p99
        )


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet to count towards goodput."""

    ttft: float | None = None
    """Most seconds to the first token."""
    tpot: float | None = None
    """Most seconds per output token after the first."""

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"slo {name}={value}: must be > 0")

    @property
    def is_set(self) -> bool:
        return self.ttft is not None or self.tpot is not None

    def is_met(self, record: RequestRecord) -> bool:
        """A completed request meets the SLOs; one with a single token has no TPOT to miss."""
        if not record.is_ok:
            return False
        if self.ttft is not None and (record.ttft is None or record.ttft > self.ttft):
            return False
        tpot = record.tpot
        return self.tpot is None or tpot is None or tpot <= self.tpot


@dataclass(frozen=True)
class RunSummary:
    """The figures of one run (one load level)."""

    duration: float
    num_completed: int
    num_failed: int
    errors: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    """Requests/s that met every given SLO; None when no SLO was given."""
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None


def _rate(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def summarize(records: Sequence[RequestRecord], duration: float, slo: Slo) -> RunSummary:
    """Throughputs count completed requests only; failed ones count in ``errors``."""
    ok = [r for r in records if r.is_ok]
    errors = Counter(r.error or "INCOMPLETE" for r in records if not r.is_ok)
    num_in = sum(r.prompt_tokens for r in ok)
    num_out = sum(r.completion_tokens for r in ok)
    goodput = _rate(sum(slo.is_met(r) for r in ok), duration) if slo.is_set else None
    return RunSummary(
        duration=duration,
        num_completed=len(ok),
        num_failed=len(records) - len(ok),
        errors=dict(sorted(errors.items())),
        total_input_tokens=num_in,
        total_output_tokens=num_out,
        request_throughput=_rate(len(ok), duration),
        output_throughput=_rate(num_out, duration),
        total_token_throughput=_rate(num_in + num_out, duration),
        goodput=goodput,
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itl]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
    )
