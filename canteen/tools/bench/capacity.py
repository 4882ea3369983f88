"""How many instances carry a given load within a TTFT SLO, from a concurrency sweep.

Little's law: one instance held at concurrency C, where a request takes T_avg seconds end
to end, completes C / T_avg requests per second. The plan takes the highest swept level
whose TTFT percentile meets the SLO and needs K = ceil(QPS * T_avg / C) instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from canteen.tools.bench.runner import BenchRun
from canteen.tools.bench.stats import percentile


@dataclass(frozen=True)
class LevelFigures:
    """What one sweep level measured."""

    concurrency: int
    ttft: float
    """The chosen percentile of TTFT, seconds."""
    mean_e2e: float
    """Mean end-to-end latency, seconds (T_avg)."""
    request_throughput: float
    """Completed requests per second, as measured."""
    num_failed: int


@dataclass(frozen=True)
class CapacityPlan:
    """The instances needed and the level the figure came from."""

    qps: float
    slo_ttft: float
    percentile: float
    level: LevelFigures
    num_instances: int

    @property
    def per_instance_qps(self) -> float:
        """C / T_avg: what one instance carries at the chosen level."""
        return self.level.concurrency / self.level.mean_e2e


class NoLevelMeetsSloError(Exception):
    """No swept level met the SLO; ``best`` is the level with the lowest TTFT, if any."""

    def __init__(self, message: str, best: LevelFigures | None) -> None:
        super().__init__(message)
        self.best = best


def level_figures(run: BenchRun, q: float) -> LevelFigures | None:
    """None for a rate run or a level where nothing completed."""
    if run.concurrency is None:
        return None
    ok = [r for r in run.records if r.is_ok and r.ttft is not None and r.e2e is not None]
    if not ok:
        return None
    return LevelFigures(
        concurrency=run.concurrency,
        ttft=percentile([r.ttft for r in ok if r.ttft is not None], q),
        mean_e2e=sum(r.e2e for r in ok if r.e2e is not None) / len(ok),
        request_throughput=run.summary.request_throughput,
        num_failed=run.summary.num_failed,
    )


def num_instances(qps: float, mean_e2e: float, concurrency: int) -> int:
    """K = ceil(QPS * T_avg / C), at least 1."""
    if not qps > 0:
        raise ValueError(f"qps={qps}: must be > 0")
    if not mean_e2e > 0:
        raise ValueError(f"mean_e2e={mean_e2e}: must be > 0")
    # Rounded first so 2.0000000001 from float error does not become 3.
    return max(1, math.ceil(round(qps * mean_e2e / concurrency, 9)))


def plan_capacity(
    levels: Sequence[LevelFigures], qps: float, slo_ttft: float, q: float = 90
) -> CapacityPlan:
    """A level qualifies when its TTFT percentile is within the SLO and no request failed."""
    if not slo_ttft > 0:
        raise ValueError(f"slo_ttft={slo_ttft}: must be > 0")
    meeting = [lv for lv in levels if lv.ttft <= slo_ttft and lv.num_failed == 0]
    if not meeting:
        best = min(levels, key=lambda lv: lv.ttft, default=None)
        measured = (
            f"best measured p{q:g} TTFT {best.ttft:.4f} s at concurrency {best.concurrency}"
            if best is not None
            else "no level completed a request"
        )
        raise NoLevelMeetsSloError(
            f"no level meets p{q:g} TTFT <= {slo_ttft:g} s without failures; {measured}", best
        )
    chosen = max(meeting, key=lambda lv: lv.concurrency)
    return CapacityPlan(
        qps=qps,
        slo_ttft=slo_ttft,
        percentile=q,
        level=chosen,
        num_instances=num_instances(qps, chosen.mean_e2e, chosen.concurrency),
    )
