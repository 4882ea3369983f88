"""The scheduler's Connect stream on a private Unix socket (canteen/local_socket.py), for
gateways on the same host and user: the first batch of a gRPC Connect stream names it
(``ScheduleBatch.local_socket``), and a gateway that reaches it moves its shared stream
there (gateway/upstream_local.py). Requests, tokens, failures, deadlines and drains are
the gRPC stream's own (``SchedulerServicer.connect_stream``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from canteen.local_socket import LocalServer
from canteen.v1 import scheduler_pb2
from scheduler.server import SchedulerServicer

# The hello a gateway expects from the scheduler's socket.
HELLO = "scheduler"


def local_connect(servicer: SchedulerServicer) -> LocalServer:
    """A server of ``servicer``'s Connect stream, not yet listening."""

    async def serve(payloads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for batch in servicer.connect_stream(_requests(payloads), "unix"):
            yield batch.SerializeToString()

    return LocalServer("canteen-scheduler-", HELLO, serve)


async def _requests(payloads: AsyncIterator[bytes]) -> AsyncIterator[scheduler_pb2.ConnectRequest]:
    async for payload in payloads:
        yield scheduler_pb2.ConnectRequest.FromString(payload)
