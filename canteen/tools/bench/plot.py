"""A PNG of a benchmark: latency CDFs per run and, for sweeps, throughput against load."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from canteen.tools.bench.runner import BenchRun

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _values(run: BenchRun, name: str) -> list[float]:
    ok = [r for r in run.records if r.is_ok]
    if name == "itl":
        return [g for r in ok for g in r.itl]
    return [v for r in ok if (v := getattr(r, name)) is not None]


def _cdf(ax: Axes, runs: Sequence[BenchRun], name: str, slo: float | None) -> None:
    largest = 0.0
    for run in runs:
        values = _values(run, name)
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=np.float64)) * 1000
        ys = np.arange(1, len(xs) + 1) / len(xs)
        # from 0 at the smallest value, so the first step is drawn
        ax.plot(np.r_[xs[0], xs], np.r_[0.0, ys], drawstyle="steps-post", label=run.mode.label)
        largest = max(largest, float(xs[-1]))
    if slo is not None:
        slo_ms = slo * 1000
        if slo_ms <= 1.5 * largest:
            ax.axvline(slo_ms, color="black", linestyle="--", linewidth=1, label="SLO")
        else:  # far right of every request: a line there would squash the curves
            ax.plot([], [], " ", label=f"SLO {slo_ms:g} ms (off scale)")
    ax.set_title(f"{name.upper()} CDF")
    ax.set_xlabel(f"{name.upper()} (ms)")
    ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def _load(ax: Axes, runs: Sequence[BenchRun]) -> None:
    levels = [r.concurrency or 0 for r in runs]
    tput = [r.summary.output_throughput for r in runs]
    ttft = [np.nan if r.summary.ttft is None else r.summary.ttft.p50 * 1000 for r in runs]
    ax.plot(levels, tput, marker="o", color="tab:blue", label="output tok/s")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    twin.plot(levels, ttft, marker="s", color="tab:red", label="p50 TTFT")
    twin.set_ylabel("p50 TTFT (ms)", color="tab:red")
    ax.set_title("throughput and TTFT vs load")


def write_plot(runs: Sequence[BenchRun], path: str | Path, title: str = "canteen bench") -> None:
    """Four panels: TTFT, TPOT and E2E CDFs, then load (sweeps) or the ITL CDF."""
    # Imported here: matplotlib costs most of a second and only plots need it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    slo = runs[0].slo if runs else None
    _cdf(axes[0][0], runs, "ttft", slo.ttft if slo else None)
    _cdf(axes[0][1], runs, "tpot", slo.tpot if slo else None)
    _cdf(axes[1][0], runs, "e2e", None)
    is_sweep = len(runs) > 1 and all(r.concurrency is not None for r in runs)
    if is_sweep:
        _load(axes[1][1], runs)
    else:
        _cdf(axes[1][1], runs, "itl", None)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
