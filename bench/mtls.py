"""What mutual TLS on every internal link costs: the same suite with mTLS vs --insecure.

Two suites on SmolLM2 run side by side on this machine (each idle while the other is
measured): one whose registry, scheduler, worker and gateway talk over mutual TLS with
certificates from a throwaway CA, one started with --insecure. Each round runs N concurrent
greedy streams of M new tokens (ignore_eos) through each gateway's gRPC port, alternating
which goes first, with prompts no earlier round used (neither prefix cache helps). The
ratio per round is paired.

Usage: python bench/mtls.py [--streams 16] [--tokens 64] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from bench.http_vs_grpc import over_grpc as throughput
from canteen.certs import make_suite_certs
from tests.support.suite import default_model_stack


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"mtls": [], "insecure": []}
    kv = ["--kv-cache-memory", "512MiB", "--dtype", "auto"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stacks:
        certs = Path(tmp) / "certs"
        make_suite_certs(certs)
        gateways = {
            "mtls": stacks.enter_context(
                default_model_stack(Path(tmp) / "mtls", worker_args=kv, certs=certs)
            ).gateway.address,
            "insecure": stacks.enter_context(
                default_model_stack(Path(tmp) / "insecure", worker_args=kv)
            ).gateway.address,
        }
        for kind, address in gateways.items():  # warm both
            asyncio.run(throughput(address, 2, 4, f"warm {kind}"))
        for r in range(args.rounds):
            order = ["mtls", "insecure"] if r % 2 == 0 else ["insecure", "mtls"]
            for kind in order:
                tps = asyncio.run(throughput(gateways[kind], args.streams, args.tokens, f"r{r}"))
                results[kind].append(tps)
                print(f"round {r + 1} {kind}: {tps:.1f} tok/s", flush=True)
    paired = [m / i for m, i in zip(results["mtls"], results["insecure"], strict=True)]
    report = {
        "cpu": cpu_model(),
        "streams": args.streams,
        "tokens": args.tokens,
        "tok_per_s": results,
        "mtls_over_insecure_per_round": [round(p, 3) for p in paired],
        "mtls_over_insecure_median": round(statistics.median(paired), 3),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
