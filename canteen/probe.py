"""``python -m canteen.probe ADDRESS``: one grpc.health.v1 Health/Check, for container healthchecks.

Prints the status and exits 0 only when it is SERVING; 1 for any other answer (NOT_SERVING,
SERVICE_UNKNOWN, UNKNOWN, or an RPC error such as NOT_FOUND for an unregistered service);
2 when nothing answers at ADDRESS within the timeout. ``--service ""`` (the default) asks for
liveness; a service's full name (``canteen.v1.Worker``) asks for its readiness.

Docker compose runs it inside each container; Kubernetes uses its native ``grpc:`` probes.
It imports only grpc and the health stubs, so it starts fast and never loads torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = 0
NOT_SERVING = 1
UNREACHABLE = 2
_UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    """One Health/Check: ``(exit code, what to print)``."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        try:
            # Wait for the connection within the timeout instead of failing on the first try.
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return UNREACHABLE, f"UNREACHABLE: nothing answered at {address} within {timeout}s"
        stub = health_pb2_grpc.HealthStub(channel)
        left = max(deadline - time.monotonic(), 0.1)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=left)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            text = f"{code.name}: {exc.details() if isinstance(exc, grpc.Call) else exc}"
            return (UNREACHABLE if code in _UNREACHABLE_CODES else NOT_SERVING), text
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    return (SERVING if ok else NOT_SERVING), name


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m canteen.probe",
        description="gRPC health probe: exit 0 when SERVING, 1 otherwise, 2 when unreachable",
    )
    parser.add_argument("address", help="HOST:PORT of the server")
    parser.add_argument(
        "--service", default="", help='service to check ("" = liveness, e.g. canteen.v1.Worker)'
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout={args.timeout}: must be > 0")
    code, text = check(args.address, args.service, args.timeout)
    print(text, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
