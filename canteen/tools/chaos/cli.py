"""``canteen chaos``: the flags, and the run against services that are already up."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from canteen.local import add_client_flags, client_tls
from canteen.tools.chaos.faults import (
    FAULT_KINDS,
    GATEWAY_KINDS,
    Fault,
    ShellInjector,
    parse_faults,
)
from canteen.tools.chaos.report import RETRYABLE, Report
from canteen.tools.chaos.runner import ChaosConfig, ChaosError, run_chaos
from canteen.tools.chaos.up import UpInjector
from canteen.tools.up.state import is_running, read_state, state_path

COMMAND = "chaos"
_DESCRIPTION = """\
Greedy load through the gateway(s) while faults are injected from a schedule. Every request
must complete with exactly the tokens of a fault-free run (computed first) or fail with a
retryable status having sent a prefix of them; afterwards no KV block may stay held."""
_EPILOG = f"""\
Kinds: {", ".join(FAULT_KINDS)}.
Targets: a worker id for workers, a gateway (name or address) for gateways, none for the
scheduler.

Against a running `canteen up` (the default, found by its state file --state), chaos kills
or drains the children itself: kill-worker is SIGKILL, the others SIGTERM (a drain), and
canteen up's supervisor starts each again; chaos waits until it serves again. The gateway,
the scheduler and the client certificate come from canteen up's data folder too:

  canteen chaos --requests 120 --faults kill-worker:worker-0,restart-worker:worker-1,\
drain-gateway:gateway,restart-scheduler

For services started another way, give each kind its command: --on KIND=COMMAND, run by
`sh -c` with {{target}} replaced by the shell-quoted target (also in $CHAOS_TARGET). chaos
waits for it to exit (--fault-timeout), then for the restarted service to serve again
(--ready-timeout):

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
    p.add_argument(
        "--gateway", action="append", default=[], help="repeatable (default: canteen up's)"
    )
    p.add_argument("--scheduler", default=env("CANTEEN_SCHEDULER", ""), help="default: ditto")
    p.add_argument(
        "--state",
        default=str(state_path()),
        help="state file of the canteen up to drive (default: DATA/suite.json)",
    )
    add_client_flags(p)
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


def _injector(
    args: argparse.Namespace, faults: list[Fault]
) -> tuple[ShellInjector | UpInjector, list[Fault]]:
    """Shell commands when --on is given, else the running canteen up (gateway targets as
    addresses, which chaos probes after a restart)."""
    commands = _commands(args.on)
    if commands or not faults:
        missing = sorted({f.kind for f in faults} - set(commands))
        if missing:
            raise ChaosError(f"no --on command for {', '.join(missing)}")
        return ShellInjector(commands, args.fault_timeout), faults
    up = UpInjector(Path(args.state), args.fault_timeout)
    try:
        up.state()
        faults = [
            Fault(f.kind, up.gateway_address(f.target)) if f.kind in GATEWAY_KINDS else f
            for f in faults
        ]
    except RuntimeError as exc:
        raise ChaosError(str(exc)) from None
    return up, faults


def _addresses(args: argparse.Namespace) -> tuple[list[str], str]:
    """The gateways and the scheduler: the flags, else $CANTEEN_*, else the running canteen
    up's, else the default ports."""
    state = read_state(Path(args.state))
    up = state if state is not None and is_running(state) else None
    gateway = os.environ.get("CANTEEN_GATEWAY", "")
    if not gateway and up is not None:
        host = "127.0.0.1" if up.host in ("", "0.0.0.0", "::") else up.host
        gateway = f"{host}:{up.base_port}"
    scheduler = args.scheduler or (f"127.0.0.1:{up.base_port + 1}" if up else "127.0.0.1:50052")
    return args.gateway or [gateway or "127.0.0.1:50051"], scheduler


def _config(args: argparse.Namespace, faults: list[Fault], supervised: bool) -> ChaosConfig:
    gateways, scheduler = _addresses(args)
    return ChaosConfig(
        gateways=gateways,
        scheduler=scheduler,
        faults=faults,
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
        tls=client_tls(args),
        supervised=supervised,
    )


def run(args: argparse.Namespace) -> int:
    try:
        injector, faults = _injector(args, args.faults)
        up = injector if isinstance(injector, UpInjector) else None
        config = _config(args, faults, supervised=up is not None)
        restarts = up.restarts if up is not None else None
        report: Report = asyncio.run(run_chaos(config, injector, restarts))
    except (ChaosError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = report.to_dict()
    print(json.dumps(data, indent=2) if args.json else report.format())
    if args.report:
        Path(args.report).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0 if report.ok else 1
