"""The scheduler's worker pool follows the registry's directory, including the changes that
happen while it is still dialling a worker: a worker that leaves as it is dialled is not kept,
and a worker id that re-registers at a new address is dialled there.

Real gRPC on loopback: one server plays the registry (GetModel) and fake workers (GetInfo,
Run); the directory's snapshots are given to the pool as its watch stream would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from canteen.v1 import registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler.link import LinkSettings
from scheduler.router import WorkerPool

BOUND_S = 10.0  # a bound on each wait, not a timing


class Registry(registry_pb2_grpc.RegistryServicer):
    async def GetModel(
        self, request: registry_pb2.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelRecord:
        return registry_pb2.ModelRecord(name=request.name, version=request.version)


class Worker(worker_pb2_grpc.WorkerServicer):
    """Answers GetInfo once ``answer`` is set; its Run stream takes plans until closed."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.asked = asyncio.Event()

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        self.asked.set()
        await self.answer.wait()
        return worker_pb2.WorkerInfo(
            worker_id="w1",
            model="m",
            version="v",
            num_blocks=64,
            block_size=16,
            max_model_len=1024,
            max_batched_tokens=256,
            vocab_size=100,
            eos_token_ids=[2],
        )

    async def Run(
        self, plans: AsyncIterator[worker_pb2.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepResult]:
        async for _ in plans:
            pass  # the pool sends no work here
        return
        yield  # an empty stream


async def _serve(servicers: list[object]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    for servicer in servicers:
        if isinstance(servicer, Registry):
            registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
        else:
            worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _directory(*entries: tuple[str, str]) -> registry_pb2.WorkerList:
    return registry_pb2.WorkerList(
        workers=[
            registry_pb2.WorkerEntry(worker_id=w, address=a, model="m", version="v")
            for w, a in entries
        ]
    )


async def _until(condition: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(BOUND_S):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.fixture
async def pool() -> AsyncIterator[WorkerPool]:
    async def ready(_: bool) -> None:
        return None

    registry, address = await _serve([Registry()])  # type: ignore[abstract]
    pool = WorkerPool(address, LinkSettings(), ready)
    yield pool
    for link in pool.links.values():
        link.drain()
    for task in list(pool._tasks):
        task.cancel()
    await registry.stop(None)


async def test_a_worker_that_leaves_the_directory_while_dialled_is_not_kept(
    pool: WorkerPool,
) -> None:
    worker = Worker()
    server, address = await _serve([worker])
    try:
        await pool._apply(_directory(("w1", address)))
        await asyncio.wait_for(worker.asked.wait(), BOUND_S)
        await pool._apply(_directory())  # stopped as it started: deregistered
        worker.answer.set()
        await _until(lambda: "w1" not in pool._connecting, "the dial to end")
        # It was linked, drained at once, and its link ended: not listed, not routed to.
        await _until(lambda: "w1" not in pool.links, "the link to end")
        assert pool.serving("m", "v") == []
    finally:
        await server.stop(None)


async def test_a_worker_id_listed_at_a_new_address_is_dialled_there(pool: WorkerPool) -> None:
    first, second = Worker(), Worker()
    first.answer.set()
    second.answer.set()
    server1, address1 = await _serve([first])
    server2, address2 = await _serve([second])
    try:
        await pool._apply(_directory(("w1", address1)))
        await _until(lambda: "w1" in pool.links, "the first link")
        # The worker restarted under its id on another port while idle: its old link never
        # read its stream, so only the directory can say it moved.
        await server1.stop(None)
        await pool._apply(_directory(("w1", address2)))
        await _until(
            lambda: "w1" in pool.links and pool.links["w1"].desc.address == address2,
            "the link to the new address",
        )
        assert [link.desc.address for link in pool.serving("m", "v")] == [address2]
    finally:
        await server2.stop(None)
