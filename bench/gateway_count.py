"""One gateway process against several on one port (``--reuse-port``), each as a share of
the engine in-process: ``python bench/shared_stream.py --tiny --gateways N``.

One registry, scheduler and worker of the tiny random model (steps of about a millisecond,
where the edge bounds the suite); in front of the scheduler, one gateway alone on a port and
N gateways sharing another. The client, at nice 19 in its own process, spreads the streams
over CHANNELS channels of their own (a gRPC channel keeps one connection, and the kernel
places connections, not requests). The engine is the worker's code in this process
(ModelRunner, no gRPC) on the same prompts, at the worker's dtype. Rounds alternate the
order of the three; every run has its own prompts. Prints one JSON line per run, then the
medians: suite tokens per second over the engine's, per gateway count and stream count.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.decode_step import cpu_model
from bench.throughput import BLOCK, engine_run, questions, worker_info
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import Service, Suite, free_port, wait_serving
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import load_model

CHANNELS = 8


def spread_run(address: str, texts: list[str], tokens: int, channels: int) -> float:
    """Tokens per second of ``texts`` sent at once over ``channels`` connections."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    opened = [grpc.insecure_channel(address, options) for _ in range(channels)]
    for channel in opened:
        grpc.channel_ready_future(channel).result(timeout=30)
    stubs = [inference_pb2_grpc.InferenceStub(channel) for channel in opened]
    requests = [
        inference_pb2.GenerateRequest(
            prompt=text, max_tokens=tokens, temperature=0, ignore_eos=True
        )
        for text in texts
    ]

    def read(call: Any) -> int:
        return sum(len(m.token_ids) for m in call)

    start = time.perf_counter()
    calls = [stubs[i % channels].Generate(req, timeout=900) for i, req in enumerate(requests)]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        produced = sum(pool.map(read, calls))
    elapsed = time.perf_counter() - start
    for channel in opened:
        channel.close()
    assert produced == len(texts) * tokens, produced
    return produced / elapsed


def start_gateways(suite: Suite, registry: Service, scheduler: Service, n: int) -> str:
    """``n`` gateways on one free port (with --reuse-port when n > 1); the address."""
    port = free_port()
    for i in range(n):
        args = ["--registry", registry.address, "--scheduler", scheduler.address]
        args += ["--http-port", "-1", "--health-port", str(free_port())]
        args += ["--reuse-port"] if n > 1 else []
        suite.spawn(f"gateway-{n}-{i}", "gateway", args, "canteen.v1.Inference", port=port)
    return f"127.0.0.1:{port}"


class Sides:
    """The suite through each gateway count, and the engine, on the same tiny model."""

    def __init__(self, suite: Suite, workdir: Path, counts: list[int], blocks: int) -> None:
        from transformers import AutoTokenizer

        from tests.support.tiny_model import build_tiny_model

        model = build_tiny_model(workdir / "tiny")
        registry = suite.start_tiny_registry(model)
        scheduler = suite.start_scheduler(registry)
        worker = suite.start_worker(registry, "tiny", "--kv-cache-memory", "1GiB")
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 120, role="scheduler")
        self.addresses = {
            f"gateways={n}": start_gateways(suite, registry, scheduler, n) for n in counts
        }
        self.dtype = worker_info(worker.address).dtype
        loaded = load_model(
            str(model), "safetensors", "", torch.device("cpu"), getattr(torch, self.dtype), False
        )
        self.runner = ModelRunner(loaded, RunnerConfig(blocks, BLOCK, 2048))
        self.tok = AutoTokenizer.from_pretrained(str(model))
        context = multiprocessing.get_context("spawn")
        self.client = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=context, initializer=os.nice, initargs=(19,)
        )

    @property
    def names(self) -> list[str]:
        return [*self.addresses, "engine"]

    def run(self, side: str, texts: list[str], tokens: int) -> float:
        if side != "engine":
            address = self.addresses[side]
            return self.client.submit(spread_run, address, texts, tokens, CHANNELS).result()
        prompts = [list(self.tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        return engine_run(self.runner, prompts, tokens)[0]


def summary(found: dict[tuple[str, int], list[float]], width: int, sides: Sides) -> str:
    medians = {side: statistics.median(found[(side, width)]) for side in sides.names}
    engine = medians.pop("engine")
    return json.dumps(
        {
            "streams": width,
            "engine_tok_s": round(engine, 1),
            "suite_tok_s": {side: round(tps, 1) for side, tps in medians.items()},
            "suite_over_engine": {side: round(tps / engine, 3) for side, tps in medians.items()},
            "dtype": sides.dtype,
            "cpu": cpu_model(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    )


def main(widths: list[int], tokens: int, rounds: int, counts: list[int]) -> None:
    found: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        suite = Suite(Path(tmp))
        try:
            blocks = max(widths) * -(-(64 + tokens) // BLOCK)
            sides = Sides(suite, Path(tmp), counts, blocks)
            for side in sides.names:  # warm: tokenizers, connections, shared streams
                sides.run(side, questions(max(widths), f"warm-{side}"), 16)
            for r in range(rounds):
                order = sides.names if r % 2 == 0 else sides.names[::-1]
                for width in widths:
                    for side in order:
                        tps = sides.run(side, questions(width, f"r{r}-{side}"), tokens)
                        found.setdefault((side, width), []).append(tps)
                        row = {"round": r, "side": side, "streams": width, "tok_s": round(tps, 1)}
                        print(json.dumps(row), flush=True)
            sides.client.shutdown()
        finally:
            suite.stop()
    for width in widths:
        print(summary(found, width, sides), flush=True)
