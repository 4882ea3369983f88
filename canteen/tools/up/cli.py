"""The ``canteen up`` flags."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from canteen.tools.up.gateways import share_rate_limits
from canteen.tools.up.launcher import Launcher
from canteen.tools.up.layout import HTTP_OFFSET, MAX_GATEWAYS, SuiteLayout
from canteen.tools.up.state import state_path

COMMAND = "up"
_EPILOG = """\
Every child that exits without being asked to is started again after 1 s, then 2, 4, ...
up to 30 s (back to 1 s after a minute of health). A child that exits 5 times within 2
minutes stays down: the suite carries on without a worker while another is left, and stops
with a message otherwise. The state of every child (PID, ports, restarts) is in
DATA/suite.json and on the gateway's /status page."""


def _pass_through(parser: argparse.ArgumentParser, kind: str, example: str) -> None:
    parser.add_argument(
        f"--{kind}-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help=f"extra flag for the {kind}{'s' if kind == 'worker' else ''} (repeatable), "
        f"e.g. --{kind}-arg={example}",
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser(
        COMMAND,
        help="run registry, scheduler, workers and gateway, restarting any that crashes",
        epilog=_EPILOG,
    )
    up.add_argument(
        "--base-port",
        type=int,
        default=50051,
        help="gateway port; scheduler +1, registry +2, metrics +3..+5, HTTP "
        f"+{HTTP_OFFSET}, workers +10.., worker metrics +74.., with --gateways N: "
        "gateway health +138.., gateway metrics +146..",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"OpenAI-compatible HTTP port (default: base port + {HTTP_OFFSET}; -1: off)",
    )
    up.add_argument("--workers", type=int, default=1, help="number of workers")
    up.add_argument(
        "--gateways",
        type=int,
        default=1,
        help=f"gateway processes sharing the gateway's gRPC and HTTP ports (1..{MAX_GATEWAYS}; "
        "each gets the per-key rate limits divided by this number)",
    )
    up.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        help="send traces of gateway, scheduler and workers to this OTLP/gRPC endpoint",
    )
    up.add_argument("--model", default="", help="model the workers serve (default: SmolLM2)")
    up.add_argument(
        "--add-model",
        action="append",
        default=[],
        metavar="NAME:VERSION=PATH",
        help="register a model at start (repeatable)",
    )
    up.add_argument("--db", default="", help="registry database (default: a per-user file)")
    up.add_argument("--host", default="127.0.0.1", help="interface the gateway binds")
    _pass_through(up, "worker", "--num-kv-blocks=64")
    _pass_through(up, "scheduler", "--max-queue=64")
    _pass_through(up, "gateway", "--api-keys-file=keys.txt")
    _pass_through(up, "registry", "--lease-ttl=5")
    up.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext internal links (default: mutual TLS with a CA made at start)",
    )
    up.add_argument(
        "--model-root",
        action="append",
        default=[],
        help="folder `canteen models add` may register from (repeatable; default: your home)",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every service to be ready",
    )


def run(args: argparse.Namespace) -> int:
    try:
        layout = SuiteLayout(
            base_port=args.base_port,
            num_workers=args.workers,
            num_gateways=args.gateways,
            model=args.model,
            add_models=args.add_model,
            db=args.db,
            host=args.host,
            http_port=args.http_port,
            otlp_endpoint=args.otlp_endpoint,
            insecure=args.insecure,
            model_roots=tuple(args.model_root),
            worker_args=args.worker_arg,
            scheduler_args=args.scheduler_arg,
            gateway_args=args.gateway_arg,
            registry_args=args.registry_arg,
            state_file=str(state_path()),
        )
        share_rate_limits(layout.gateway_args, layout.num_gateways)  # refuses a bad value
    except ValueError as exc:
        print(f"canteen up: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return asyncio.run(Launcher(layout).run(ready_timeout=args.ready_timeout))
