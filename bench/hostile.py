"""The edge under hostile requests, on the tiny random model: a concurrent stream's worst
inter-token gap and the gateway's health-probe latency, without and with hostile load.

Rounds alternate, in order: a stream of --tokens greedy tokens alone, then the same stream
while a 4 MB tokenize, a 4 MB prompt with n=4, 128 large tool schemas with n=4 and a deeply
nested schema with n=4 arrive (tests/support/hostile_load.py). Throughout, gRPC Health/Check
and HTTP /healthz probes alternate every 20 ms. Goal (issue 32): with hostile load, the gap is
at most 2x the one without, and the probe p99 at most 100 ms. Bounded: --rounds pairs, each
hostile request at most its --prep-deadline.

Usage: python bench/hostile.py [--rounds 3] [--tokens 32] [--prep-deadline 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.conftest import NUM_KV_BLOCKS, tiny_suite
from tests.support.hostile_load import Round, one_round, start_roomy_gateway
from tests.support.tiny_model import build_tiny_model


def _row(label: str, rounds: list[Round]) -> str:
    gaps = [r.stream.worst_gap * 1e3 for r in rounds]
    probes = np.array([p for r in rounds for p in r.probes]) * 1e3
    return (
        f"{label:<9} {max(gaps):>12.1f} {np.percentile(probes, 50):>9.1f} "
        f"{np.percentile(probes, 99):>9.1f} {probes.max():>9.1f} {len(probes):>7}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of rounds (alone, hostile)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of the measured stream")
    parser.add_argument("--prep-deadline", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        (Path(tmp) / "suite").mkdir()
        with tiny_suite(Path(tmp) / "suite", model, NUM_KV_BLOCKS) as suite:
            gateway = start_roomy_gateway(suite, args.prep_deadline, "gateway-hostile")
            alone: list[Round] = []
            loaded: list[Round] = []
            reference: list[int] | None = None
            for _ in range(args.rounds):
                for hostile, into in ((False, alone), (True, loaded)):
                    r = one_round(
                        gateway.address,
                        gateway.http_url,
                        args.tokens,
                        hostile,
                        lambda: time.sleep(0.3),
                    )
                    reference = reference or r.stream.token_ids
                    assert r.stream.token_ids == reference, "the stream's tokens changed"
                    into.append(r)
            gateway.terminate()
    print(f"{'load':<9} {'worst gap ms':>12} {'probe p50':>9} {'p99':>9} {'max':>9} {'probes':>7}")
    print(_row("alone", alone))
    print(_row("hostile", loaded))
    outcomes = sorted({f"{h.path} {h.status}" for r in loaded for h in r.hostile})
    print("hostile requests ended:", "; ".join(outcomes))
    gap_ratio = max(r.stream.worst_gap for r in loaded) / max(r.stream.worst_gap for r in alone)
    p99 = float(np.percentile([p for r in loaded for p in r.probes], 99)) * 1e3
    print(f"gap ratio {gap_ratio:.2f} (goal <= 2), probe p99 {p99:.1f} ms (goal <= 100)")


if __name__ == "__main__":
    main()
