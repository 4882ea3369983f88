"""``canteen bench`` and ``canteen capacity``: the flags, and what each command prints."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

from canteen.tools.bench.capacity import (
    CapacityPlan,
    LevelFigures,
    NoLevelMeetsSloError,
    level_figures,
    plan_capacity,
)
from canteen.tools.bench.clients import Client, Target, open_client
from canteen.tools.bench.report import format_run, format_sweep, report_to_dict, runs_from_dict
from canteen.tools.bench.runner import BenchRun, Concurrency, Limits, Mode, Rate, run_with
from canteen.tools.bench.server_stats import Speculation, read_speculation
from canteen.tools.bench.stats import Slo
from canteen.tools.bench.workload import (
    DatasetError,
    Workload,
    load_jsonl,
    random_text,
    random_workload,
    shared_prefix_workload,
)

COMMANDS = ("bench", "capacity")
_CALIBRATION_WORDS = 256
_SECRET_ARGS = {"api_key", "admin_key"}


class BenchError(Exception):
    """A failure the command reports in one line and exits 1 on."""


def parse_levels(text: str) -> list[int]:
    """``1,2,4,8`` to ``[1, 2, 4, 8]``; argparse reports the error."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use comma-separated integers, e.g. 1,2,4,8"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: levels must be integers >= 1")
    return levels


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    g.add_argument("--address", default=os.environ.get("CANTEEN_GATEWAY", "127.0.0.1:50051"))
    g.add_argument(
        "--url", default="http://127.0.0.1:50057", help="HTTP base URL (default: canteen up's)"
    )
    g.add_argument("--api-key", default=os.environ.get("CANTEEN_API_KEY", ""))
    g.add_argument("--model", default="", help="model name or alias (default: the default)")
    g.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    g.add_argument(
        "--status-url",
        default=None,
        help="the gateway's /status.json, read before and after each run for what the service "
        "counted (speculative acceptance); default: URL/status.json with --protocol http",
    )
    g.add_argument("--admin-key", default=os.environ.get("CANTEEN_ADMIN_KEY", ""))


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=("random", "shared-prefix", "jsonl"), default="random")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (about)")
    g.add_argument("--output-len", type=int, default=64, help="tokens to generate")
    g.add_argument("--range-ratio", type=float, default=0.5, help="lengths in len*(1 +/- r)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix tokens")
    g.add_argument("--path", default="", help="jsonl file: {prompt, max_tokens?} per line")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    g.add_argument(
        "--tokens-per-word",
        type=float,
        default=None,
        help="prompt tokens per random word (default: measured with the server's tokenizer)",
    )


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bounds")
    g.add_argument("--num-requests", type=int, default=64, help="per run (per sweep level)")
    g.add_argument("--duration", type=float, default=600.0, help="stop sending after S seconds")
    g.add_argument("--drain-timeout", type=float, default=60.0, help="then wait S for in-flight")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``bench`` and ``capacity`` to the ``canteen`` command."""
    bench = sub.add_parser("bench", help="load a running gateway and report latency/throughput")
    _add_target_args(bench)
    _add_workload_args(bench)
    _add_limit_args(bench)
    load = bench.add_argument_group("load")
    load.add_argument("--mode", choices=("concurrency", "rate", "sweep"), default="concurrency")
    load.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals, req/s")
    load.add_argument("--sweep", type=parse_levels, default=[1, 2, 4, 8], metavar="1,2,4,8")
    load.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO, seconds")
    load.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO, seconds")
    out = bench.add_argument_group("output")
    out.add_argument("--json", default="", help="write the full report here")
    out.add_argument("--plot", default="", help="write a PNG of CDFs (and load) here")

    cap = sub.add_parser(
        "capacity",
        help="instances needed for a load within a TTFT SLO, from a sweep",
        description="K = ceil(QPS * T_avg / C) at the highest swept concurrency C whose TTFT "
        "percentile meets the SLO; T_avg is that level's mean end-to-end latency.",
    )
    cap.add_argument("--qps", type=float, required=True, help="load to carry, req/s")
    cap.add_argument("--slo-ttft", type=float, required=True, help="seconds")
    cap.add_argument("--percentile", type=float, default=90.0, help="TTFT percentile to hold")
    cap.add_argument("--from", dest="from_path", default="", help="canteen bench sweep JSON")
    cap.add_argument("--sweep", type=parse_levels, default=[1, 2, 4, 8], metavar="1,2,4,8")
    cap.add_argument("--json", default="", help="write the plan here")
    cap.add_argument("--bench-json", default="", help="live sweep: write its report here")
    _add_target_args(cap)
    _add_workload_args(cap)
    _add_limit_args(cap)


def _target(args: argparse.Namespace) -> Target:
    return Target(
        protocol=args.protocol,
        address=args.address,
        url=args.url,
        api_key=args.api_key,
        model=args.model,
        timeout=args.request_timeout,
    )


async def _tokens_per_word(args: argparse.Namespace, client: Client) -> float:
    if args.tokens_per_word is not None:
        return float(args.tokens_per_word)
    text = random_text(np.random.default_rng(args.seed), _CALIBRATION_WORDS, 1.0)
    try:
        return await client.count_tokens(text) / _CALIBRATION_WORDS
    except (grpc.aio.AioRpcError, aiohttp.ClientError, RuntimeError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        raise BenchError(f"cannot tokenize on the target to size prompts: {detail}") from None


async def _workload(args: argparse.Namespace, client: Client) -> Workload:
    if args.dataset == "jsonl":
        if not args.path:
            raise DatasetError("--dataset jsonl needs --path FILE")
        return load_jsonl(args.path, args.output_len)
    tpw = await _tokens_per_word(args, client)
    shape = (args.input_len, args.output_len, args.range_ratio, args.seed, tpw)
    if args.dataset == "shared-prefix":
        return shared_prefix_workload(args.num_requests, args.prefix_len, *shape)
    return random_workload(args.num_requests, *shape)


async def _execute(
    args: argparse.Namespace, target: Target, modes: list[Mode], limits: Limits
) -> list[BenchRun]:
    status = _status_url(args)
    async with open_client(target) as client:
        workload = await _workload(args, client)
        runs = []
        for mode in modes:
            before = await _speculation(status, args)
            run = await run_with(client, workload, mode, limits)
            after = await _speculation(status, args)
            if before is not None and after is not None:
                run = dataclasses.replace(run, speculation=after - before)
            runs.append(run)
        return runs


def _status_url(args: argparse.Namespace) -> str:
    if args.status_url is not None:
        return str(args.status_url)
    return f"{args.url.rstrip('/')}/status.json" if args.protocol == "http" else ""


async def _speculation(url: str, args: argparse.Namespace) -> Speculation | None:
    if not url:
        return None
    try:
        return await read_speculation(url, args.admin_key)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        print(f"canteen bench: cannot read {url}: {exc}", file=sys.stderr)
        return None


def _modes(args: argparse.Namespace) -> list[Mode]:
    if args.command == "capacity" or args.mode == "sweep":
        return [Concurrency(n) for n in args.sweep]
    if args.mode == "rate":
        if args.rate is None:
            raise ValueError("--mode rate needs --rate QPS")
        return [Rate(args.rate, args.seed)]
    return [Concurrency(args.concurrency)]


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(args).items()
        if k not in _SECRET_ARGS and isinstance(v, str | int | float | bool | list | None)
    }


def _sweep(args: argparse.Namespace, slo: Slo) -> list[BenchRun]:
    limits = Limits(
        num_requests=args.num_requests,
        duration=args.duration,
        drain_timeout=args.drain_timeout,
        slo=slo,
        progress=not args.no_progress,
    )
    return asyncio.run(_execute(args, _target(args), _modes(args), limits))


def _write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def _bench(args: argparse.Namespace) -> int:
    runs = _sweep(args, Slo(args.slo_ttft, args.slo_tpot))
    for run in runs:
        print(format_run(run))
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.json:
        _write_json(args.json, report_to_dict(runs, _config(args)))
    if args.plot:
        from canteen.tools.bench.plot import write_plot

        where = args.address if args.protocol == "grpc" else args.url
        write_plot(runs, args.plot, f"canteen bench: {args.protocol} {where}, {args.dataset}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if any(r.summary.num_completed for r in runs) else 1


def _format_plan(plan: CapacityPlan, levels: list[LevelFigures]) -> str:
    q, lv = f"p{plan.percentile:g}", plan.level
    lines = [
        f"capacity for {plan.qps:g} req/s with {q} TTFT <= {plan.slo_ttft:g} s",
        f"{'level':>7}{q + ' TTFT ms':>14}{'mean E2E ms':>13}{'req/s':>9}{'failed':>8}",
    ]
    for f in levels:
        lines.append(
            f"{f.concurrency:>7}{f.ttft * 1000:>14.2f}{f.mean_e2e * 1000:>13.2f}"
            f"{f.request_throughput:>9.2f}{f.num_failed:>8}"
        )
    lines += [
        f"chosen level: concurrency {lv.concurrency}",
        f"  {q} TTFT: {lv.ttft:.4f} s (SLO {plan.slo_ttft:g} s)",
        f"  T_avg (mean E2E): {lv.mean_e2e:.4f} s",
        f"  measured req/s at this level: {lv.request_throughput:.3f}",
        f"  one instance carries C / T_avg = {plan.per_instance_qps:.3f} req/s",
        f"  K = ceil(QPS * T_avg / C) = ceil({plan.qps:g} * {lv.mean_e2e:.4f} / "
        f"{lv.concurrency}) = ceil({plan.qps * lv.mean_e2e / lv.concurrency:.3f})",
        f"instances: {plan.num_instances}",
    ]
    return "\n".join(lines)


def _capacity(args: argparse.Namespace) -> int:
    if args.from_path:
        try:
            runs = runs_from_dict(json.loads(Path(args.from_path).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchError(f"{args.from_path}: {exc}") from None
    else:
        runs = _sweep(args, Slo(ttft=args.slo_ttft))
        print(format_sweep(runs))
        if args.bench_json:
            _write_json(args.bench_json, report_to_dict(runs, _config(args)))
    levels = [f for run in runs if (f := level_figures(run, args.percentile)) is not None]
    try:
        plan = plan_capacity(levels, args.qps, args.slo_ttft, args.percentile)
    except NoLevelMeetsSloError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(_format_plan(plan, levels))
    if args.json:
        body = dataclasses.asdict(plan) | {"per_instance_qps": plan.per_instance_qps}
        _write_json(args.json, body | {"levels": [dataclasses.asdict(f) for f in levels]})
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs ``canteen bench`` or ``canteen capacity``; the exit status."""
    try:
        return _bench(args) if args.command == "bench" else _capacity(args)
    except (BenchError, ValueError) as exc:  # DatasetError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, BenchError) else 2
