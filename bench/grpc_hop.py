"""The CPU one streamed gRPC hop costs per token in Python (grpc.aio), server and client side.

Every token the suite streams crosses two such hops, one message each: scheduler -> gateway
and gateway -> client (the scheduler's ``Generate`` and the gateway's ``Generate`` each stream
one message per token per request). On a machine whose cores all run the worker's compute
threads, that CPU comes out of the forward. This measures the floor of a hop, with no logic
around it: an aio server streams minimal ``GenerateResponse`` messages to an aio client on
loopback, over ``--streams`` concurrent calls, and each side's CPU seconds are divided by the
tokens. ``--per-message`` > 1 packs that many tokens into each message (the token ids of one
response): what one message per step carrying every request's token would cost, as a
multiplexed scheduler -> gateway stream would send.

Usage: python bench/grpc_hop.py [--tokens 4000] [--streams 32] [--per-message 1,32]
       [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from canteen.v1 import inference_pb2, inference_pb2_grpc


class _Streamer(inference_pb2_grpc.InferenceServicer):
    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        per, messages = request.top_k, request.max_tokens  # tokens a message, messages
        for i in range(messages):
            yield inference_pb2.GenerateResponse(text="tok", token_ids=range(i, i + per))


def _serve(ports: mp.Queue) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(_Streamer(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _read(port: int, streams: int, messages: int, per: int) -> float:
    """Reads ``streams`` calls of ``messages`` messages; returns the client's CPU seconds."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one() -> None:
            request = inference_pb2.GenerateRequest(max_tokens=messages, top_k=per)
            async for _ in stub.Generate(request):
                pass

        started = time.process_time()
        await asyncio.gather(*[one() for _ in range(streams)])
        return time.process_time() - started


def hop(port: int, server: psutil.Process, tokens: int, streams: int, per: int) -> dict:
    messages = max(tokens // (streams * per), 1)
    asyncio.run(_read(port, streams, messages, per))  # warm-up: channel, first calls
    before = sum(server.cpu_times()[:2])
    client = asyncio.run(_read(port, streams, messages, per))
    served = streams * messages * per
    return {
        "per_message": per,
        "tokens": served,
        "server_us_per_token": round((sum(server.cpu_times()[:2]) - before) / served * 1e6, 1),
        "client_us_per_token": round(client / served * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--per-message", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ports: mp.Queue = mp.Queue()
    process = mp.Process(target=_serve, args=(ports,), daemon=True)
    process.start()
    port, server = ports.get(timeout=30), psutil.Process(process.pid)
    print(json.dumps({"cpu": cpu_model(), "streams": args.streams}))
    try:
        for rnd in range(args.rounds):
            sizes = [int(x) for x in args.per_message.split(",")]
            for per in sizes if rnd % 2 == 0 else sizes[::-1]:  # alternate the order
                row = hop(port, server, args.tokens, args.streams, per)
                print(json.dumps({"round": rnd, **row}), flush=True)
    finally:
        process.terminate()


if __name__ == "__main__":
    main()
