"""The worker's Run stream on a private Unix socket (canteen/local_socket.py), for a
scheduler on the same host and user: ``WorkerInfo.run_socket`` names it, and the
scheduler falls back to gRPC where it cannot reach it (scheduler/local_run.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from canteen.local_socket import LocalServer
from canteen.v1 import worker_pb2
from worker.server import WorkerServicer


def local_link(servicer: WorkerServicer) -> LocalServer:
    """A server of ``servicer``'s Run stream, not yet listening; its hello is the id."""

    async def serve(payloads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for result in servicer.run_stream(_plans(payloads), "unix"):
            yield result.SerializeToString()

    return LocalServer("canteen-worker-", servicer.identity.worker_id, serve)


async def _plans(payloads: AsyncIterator[bytes]) -> AsyncIterator[worker_pb2.StepPlan]:
    async for payload in payloads:
        yield worker_pb2.StepPlan.FromString(payload)
