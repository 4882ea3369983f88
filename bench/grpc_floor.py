"""Server CPU per streamed gRPC message on this box: grpc.aio against the sync server (a
thread pool), a few channel options, and tokens batched per message.

The gateway's client-facing stream sends a message per token per request at stream
interval 1; this measures what a message costs the sending process with no logic around
it, to choose the gateway's server design. A server process streams ``--messages`` minimal
``GenerateResponse`` messages on each of ``--streams`` concurrent calls to a client process
(niced); the server's CPU seconds (user + system, from psutil) are divided by the messages.
Variants run alternately, ``--rounds`` times each, and one JSON line is printed per run
plus a summary of medians.

Variants: ``aio`` (grpc.aio server, async generator handler), ``aio-write`` (the same with
``context.write``), ``sync`` (grpc.server with a thread pool of ``--streams`` threads),
``aio-throughput`` (aio with ``grpc.optimization_target=throughput``), ``aio-batch4``
(four tokens a message: a stream interval of 4; divided by tokens, not messages), and
``aio-call`` (calls of one message each, ``--messages`` rounds of ``--streams`` concurrent
calls: what a call itself costs, its one message included; its ``us_per_message`` is per
call).

What a request of T tokens costs the server's gRPC alone, from the medians: ``aio-call +
(messages - 1) * aio``, where messages is T at stream interval 1 and 1 + (T - 1) / 4 at 4;
printed as ``floor_us_per_token`` for ``--tokens`` (64) when both variants ran.

Usage: python bench/grpc_floor.py [--streams 32] [--messages 200] [--rounds 3]
       [--variants aio,sync,...]  (``--short``: 8 streams, 50 messages, 1 round)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import statistics
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canteen.v1 import inference_pb2, inference_pb2_grpc

VARIANTS = ("aio", "aio-write", "sync", "aio-throughput", "aio-batch4", "aio-call")


def _response(i: int, per: int) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(text="tok" * per, token_ids=range(i, i + per))


class _AioStreamer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, use_write: bool) -> None:
        self._use_write = use_write

    async def Generate(  # type: ignore[override]
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        per = request.top_k
        for i in range(request.max_tokens):
            if self._use_write:
                await context.write(_response(i, per))
            else:
                yield _response(i, per)


class _SyncStreamer(inference_pb2_grpc.InferenceServicer):
    def Generate(  # type: ignore[override]
        self, request: inference_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[inference_pb2.GenerateResponse]:
        per = request.top_k
        for i in range(request.max_tokens):
            yield _response(i, per)


def _serve(variant: str, streams: int, ports: mp.Queue) -> None:  # type: ignore[type-arg]
    options: list[tuple[str, object]] = []
    if variant == "aio-throughput":
        options = [("grpc.optimization_target", "throughput")]
    if variant == "sync":
        pool = concurrent.futures.ThreadPoolExecutor(streams + 4)
        server = grpc.server(pool, options=options)
        inference_pb2_grpc.add_InferenceServicer_to_server(_SyncStreamer(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    async def main() -> None:
        aio = grpc.aio.server(options=options)
        servicer = _AioStreamer(use_write=variant == "aio-write")
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, aio)
        ports.put(aio.add_insecure_port("127.0.0.1:0"))
        await aio.start()
        await aio.wait_for_termination()

    asyncio.run(main())


def _read(port: int, streams: int, messages: int, per: int, batches: int = 1) -> None:
    """The client: ``batches`` times ``streams`` concurrent calls of ``messages`` messages,
    all read."""
    os.nice(19)

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            async def one() -> None:
                request = inference_pb2.GenerateRequest(max_tokens=messages, top_k=per)
                async for _ in stub.Generate(request):
                    pass

            for _ in range(batches):
                await asyncio.gather(*(one() for _ in range(streams)))

    asyncio.run(main())


def run(variant: str, streams: int, messages: int) -> dict[str, object]:
    """One run: the server's CPU microseconds a message and a token."""
    per = 4 if variant == "aio-batch4" else 1
    num_messages, batches = messages // per, 1
    if variant == "aio-call":  # a message per call, as many calls as the others' messages
        num_messages, batches = 1, messages
    context = mp.get_context("spawn")
    ports: mp.Queue = context.Queue()  # type: ignore[type-arg]
    server = context.Process(target=_serve, args=(variant, streams, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        warm = context.Process(target=_read, args=(port, streams, 10, per))
        warm.start()
        warm.join()
        proc = psutil.Process(server.pid)
        before = sum(proc.cpu_times()[:2])
        client = context.Process(target=_read, args=(port, streams, num_messages, per, batches))
        client.start()
        client.join()
        used = sum(proc.cpu_times()[:2]) - before
    finally:
        server.kill()
        server.join()
    sent = streams * num_messages * batches
    return {
        "variant": variant,
        "us_per_message": round(1e6 * used / sent, 1),
        "us_per_token": round(1e6 * used / (sent * per), 1),
    }


def floors(medians: dict[str, float], tokens: int) -> dict[str, float]:
    """The server's gRPC CPU per token of a ``tokens``-token request, at stream intervals 1
    and 4, from a call's cost (``aio-call``) and a further message's (``aio``)."""
    if "aio-call" not in medians or "aio" not in medians:
        return {}
    out = {}
    for interval in (1, 4):
        messages = 1 + -(-(tokens - 1) // interval)
        cost = medians["aio-call"] + (messages - 1) * medians["aio"]
        out[f"floor_us_per_token_interval_{interval}"] = round(cost / tokens, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=64, help="a request's, for the floor")
    parser.add_argument("--short", action="store_true", help="8 streams, 50 messages, 1 round")
    args = parser.parse_args()
    if args.short:
        args.streams, args.messages, args.rounds = 8, 50, 1
    variants = args.variants.split(",")
    found: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            row = run(variant, args.streams, args.messages)
            found[variant].append(float(str(row["us_per_token"])))
            print(json.dumps({"round": r, **row}), flush=True)
    medians = {v: statistics.median(found[v]) for v in variants}
    print(json.dumps({**medians, **floors(medians, args.tokens), "tokens": args.tokens}))


if __name__ == "__main__":
    main()
