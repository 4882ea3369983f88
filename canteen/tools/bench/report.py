"""The benchmark report: a JSON document (summaries plus every request) and text tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from canteen.tools.bench.records import RequestRecord
from canteen.tools.bench.runner import BenchRun, Concurrency, Mode, Rate
from canteen.tools.bench.stats import Distribution, Slo, summarize

REPORT_VERSION = 1
_METRICS = ("ttft", "tpot", "itl", "e2e")


def _mode_dict(mode: Mode) -> dict[str, Any]:
    if isinstance(mode, Concurrency):
        return {"mode": "concurrency", "concurrency": mode.level, "rate": None}
    return {"mode": "rate", "concurrency": None, "rate": mode.qps, "seed": mode.seed}


def _record_dict(record: RequestRecord) -> dict[str, Any]:
    out = dataclasses.asdict(record)
    out["tpot"] = record.tpot
    return out


def run_to_dict(run: BenchRun) -> dict[str, Any]:
    return {
        **_mode_dict(run.mode),
        "slo": dataclasses.asdict(run.slo),
        "summary": dataclasses.asdict(run.summary),
        "speculation": None
        if run.speculation is None
        else {
            **dataclasses.asdict(run.speculation),
            "acceptance_rate": run.speculation.acceptance_rate,
        },
        "records": [_record_dict(r) for r in run.records],
    }


def report_to_dict(
    runs: Sequence[BenchRun], config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The whole report; ``config`` records how it was made (target, dataset, flags)."""
    return {
        "version": REPORT_VERSION,
        "config": dict(config or {}),
        "runs": [run_to_dict(r) for r in runs],
    }


def _record_from(data: Mapping[str, Any]) -> RequestRecord:
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    return RequestRecord(**{k: v for k, v in data.items() if k in names})


def _run_from(data: Mapping[str, Any]) -> BenchRun:
    mode: Mode = (
        Concurrency(int(data["concurrency"]))
        if data["mode"] == "concurrency"
        else Rate(float(data["rate"]), int(data.get("seed", 0)))
    )
    records = [_record_from(r) for r in data["records"]]
    slo = Slo(**data.get("slo", {}))
    duration = float(data["summary"]["duration"])
    return BenchRun(mode, records, duration, slo, summarize(records, duration, slo))


def runs_from_dict(data: object) -> list[BenchRun]:
    """Reads back what ``report_to_dict`` wrote; ValueError when it is something else."""
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError("not a canteen bench report: no 'runs' list")
    try:
        return [_run_from(r) for r in data["runs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a canteen bench report: {type(exc).__name__}: {exc}") from None


# -- text ----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def _latency_table(run: BenchRun) -> list[str]:
    lines = [f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in _METRICS:
        d: Distribution | None = getattr(run.summary, name)
        cells = (None,) * 4 if d is None else (d.mean, d.p50, d.p90, d.p99)
        lines.append(f"{name.upper():<14}" + "".join(f"{_ms(c):>10}" for c in cells))
    return lines


def _goodput_label(slo: Slo) -> str:
    parts = [f"{k}<={v:g}s" for k, v in (("ttft", slo.ttft), ("tpot", slo.tpot)) if v is not None]
    return ", ".join(parts)


def format_run(run: BenchRun) -> str:
    s = run.summary
    errors = ", ".join(f"{k}={v}" for k, v in s.errors.items()) or "none"
    rows = [
        ("Duration (s)", f"{s.duration:.2f}"),
        ("Completed / failed", f"{s.num_completed} / {s.num_failed}"),
        ("Errors", errors),
        ("Input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.1f}"),
    ]
    first = next((r for r in run.records if r.error is not None), None)
    if first is not None:
        rows.append(("First error", f"{first.error}: {first.detail}"[:60]))
    if s.goodput is not None:
        rows.append((f"Goodput (req/s, {_goodput_label(run.slo)})", f"{s.goodput:.2f}"))
    if run.speculation is not None:
        rate = run.speculation.acceptance_rate
        shown = "-" if rate is None else f"{100 * rate:.1f}%"
        rows.append(("Draft tokens / accepted", f"{run.speculation.draft_tokens} / {shown}"))
    title = f" {run.mode.label} "
    lines = [f"{title:=^54}"]
    lines += [f"{k + ':':<40}{v:>14}" for k, v in rows]
    lines += ["-" * 54, *_latency_table(run)]
    return "\n".join(lines)


def format_sweep(runs: Sequence[BenchRun]) -> str:
    """One line per level: the figures that decide capacity."""
    head = f"{'level':>6}{'done':>6}{'fail':>6}{'req/s':>9}{'out tok/s':>11}"
    head += f"{'p50 TTFT':>10}{'p90 TTFT':>10}{'mean E2E':>10}"
    lines = [f"{' sweep (latencies in ms) ':=^68}", head]
    for run in runs:
        s = run.summary
        p50 = None if s.ttft is None else s.ttft.p50
        p90 = None if s.ttft is None else s.ttft.p90
        mean_e2e = None if s.e2e is None else s.e2e.mean
        lines.append(
            f"{run.concurrency or 0:>6}{s.num_completed:>6}{s.num_failed:>6}"
            f"{s.request_throughput:>9.2f}{s.output_throughput:>11.1f}"
            f"{_ms(p50):>10}{_ms(p90):>10}{_ms(mean_e2e):>10}"
        )
    return "\n".join(lines)
