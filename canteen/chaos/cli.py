"""``canteen chaos``: the flags, and the run against services that are already up."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from canteen.chaos.faults import FAULT_KINDS, ShellInjector, parse_faults
from canteen.chaos.report import RETRYABLE
from canteen.chaos.runner import ChaosConfig, ChaosError, run_chaos

COMMAND = "chaos"
_DESCRIPTION = """\
Greedy load through the gateway(s) while faults are injected from a schedule. Every request
must complete with exactly the tokens of a fault-free run (computed first) or fail with a
retryable status having sent a prefix of them; afterwards no KV block may stay held."""
_EPILOG = f"""\
Each --faults kind needs its command: --on KIND=COMMAND, run by `sh -c` with {{target}}
replaced by the shell-quoted target (also in $CHAOS_TARGET). chaos waits for it to exit
(--fault-timeout), then for the restarted service to serve again (--ready-timeout).
Kinds: {", ".join(FAULT_KINDS)}.
Targets: a worker id for workers, a gateway address for gateways, none for the scheduler.
Use services started one by one: `canteen up` stops the whole suite when one service exits.

  canteen chaos --gateway 127.0.0.1:50051 --gateway 127.0.0.1:50055 --requests 200 \\
    --faults kill-worker:worker-0,restart-worker:worker-0,\\
drain-gateway:127.0.0.1:50055,restart-gateway:127.0.0.1:50055,restart-scheduler \\
    --on 'kill-worker=kill -9 $(cat run/{{target}}.pid)' \\
    --on 'restart-worker=./start.sh {{target}}' \\
    --on 'drain-gateway=p=$(cat run/gw-b.pid); kill $p; while kill -0 $p; do sleep .1; done' \\
    --on 'restart-gateway=./start.sh gw-b' \\
    --on 'restart-scheduler=systemctl restart canteen-scheduler'

Exit status: 0 when no request was lost, no KV block leaked and every fault succeeded; 1
otherwise; 2 when the run could not be made."""


def _commands(items: list[str]) -> dict[str, str]:
    commands = {}
    for item in items:
        kind, sep, command = item.partition("=")
        if not sep or kind not in FAULT_KINDS or not command.strip():
            raise ChaosError(f"--on {item!r}: use KIND=COMMAND, KIND one of {FAULT_KINDS}")
        commands[kind] = command
    return commands


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use integers, e.g. 16,32,64") from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        COMMAND,
        help="load the gateway while faults are injected; check every request and the KV pools",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ.get
    p.add_argument("--gateway", action="append", default=[], help="repeatable (default :50051)")
    p.add_argument("--scheduler", default=env("CANTEEN_SCHEDULER", "127.0.0.1:50052"))
    p.add_argument("--requests", type=int, default=200, help="in all, references aside")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=120.0, help="seconds the load is paced over")
    p.add_argument("--max-tokens", type=_lengths, default=(16, 32, 48, 64), metavar="16,32,..")
    p.add_argument(
        "--faults",
        type=parse_faults,
        default=[],
        metavar="KIND[:TARGET],...",
        help="in order, spread evenly through the requests (none: load and checks only)",
    )
    p.add_argument(
        "--on", action="append", default=[], metavar="KIND=COMMAND", help="repeatable; below"
    )
    p.add_argument("--fault-timeout", type=float, default=120.0, help="seconds per command")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="after a restart")
    p.add_argument("--request-timeout", type=float, default=90.0)
    p.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="tries per request, the next on the next gateway, while one fails UNAVAILABLE "
        "before any token",
    )
    p.add_argument(
        "--retryable",
        default=",".join(RETRYABLE),
        help="codes a failed request may end with, comma-separated; any other code (e.g. "
        "DEADLINE_EXCEEDED, CANCELLED, INTERNAL) counts it as lost",
    )
    p.add_argument("--settle", type=float, default=10.0, help="seconds for the pools to be whole")
    p.add_argument("--model", default="")
    p.add_argument("--api-key", default=env("CANTEEN_API_KEY", ""))
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--report", default="", metavar="PATH", help="also write the JSON report")


def run(args: argparse.Namespace) -> int:
    try:
        commands = _commands(args.on)
        missing = sorted({f.kind for f in args.faults} - set(commands))
        if missing:
            raise ChaosError(f"no --on command for {', '.join(missing)}")
        config = ChaosConfig(
            gateways=args.gateway or [os.environ.get("CANTEEN_GATEWAY", "127.0.0.1:50051")],
            scheduler=args.scheduler,
            faults=args.faults,
            requests=args.requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            duration=args.duration,
            request_timeout=args.request_timeout,
            attempts=args.attempts,
            retryable=tuple(c.strip().upper() for c in args.retryable.split(",") if c.strip()),
            ready_timeout=args.ready_timeout,
            settle=args.settle,
            model=args.model,
            api_key=args.api_key,
        )
        report = asyncio.run(run_chaos(config, ShellInjector(commands, args.fault_timeout)))
    except ChaosError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = report.to_dict()
    print(json.dumps(data, indent=2) if args.json else report.format())
    if args.report:
        Path(args.report).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0 if report.ok else 1
