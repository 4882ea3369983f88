"""One side of bench/revisions.py: loads SmolLM2 with the default settings from whatever tree
is first on PYTHONPATH, and prints one JSON line of timings (ms): a decode step at each
--batches width (median of --steps steps after a warm-up) and the prefill of one --prompt
token prompt in chunks of max_batched_tokens. It uses only the runner's public API, which
both revisions share.

``--interference CHUNK`` instead times what bench/kv.py's interference scenario asks of the
worker, in-process: 8 sequences decode while a --prompt token prompt is prefilled beside
them in CHUNK-token chunks, or (``--interference 0``) in chunks that the scheduler's cost
model (scheduler/cost.py; ``--max-stall``, default the scheduler's) sizes from these steps'
CPU times. It prints the decode-only steps' median and the worst (and 90th percentile) step
with a chunk over it, in process-CPU time, and with ``--verbose`` one JSON line per step
with a chunk (its position, wall and CPU ms), so a step's cost can be read against its
chunk's position.
``--blind-cost`` sizes them as the model did before it told decode-only steps apart (for a
side-by-side run). ``--repeat 2`` runs it twice (the second warm, the cost model keeps what
it learned). ``over_bound``: a chunk step's CPU time over the step time the cost model held
it to (its ``bound_seconds``), the figure that shows whether the model's estimates hold;
``--decode-every 16`` adds a decode-only step (unseen by the cost model) every 16 steps and
rates each chunk step against the latest one (``over_decode``, ``*_over_decode_beside``): the
streams' contexts grow here, so the decode steps before the prompt understate late ones.
``--attention 1900`` times one layer's attention kernel alone (thread CPU ms): 8 decode rows,
and chunks of 16, 64 and 256 rows after 1,900 cached tokens.
``--threads 1`` with ``OMP_NUM_THREADS=1`` makes CPU time one core's work, the figure that
holds up on a loaded host. Example:
``OMP_NUM_THREADS=1 python bench/step_probe.py --interference 16 --threads 1 --repeat 2``.

Like a worker once ready (canteen/heap.py), the probe freezes the heap the model load built
before it steps; ``--no-freeze`` leaves it to Python's collector, whose full collections then
walk the whole model's objects inside whichever step set them off. Each step's record has
``gc_ms``, the CPU time the collector ran inside it, and the summary the worst step's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time

import torch

from canteen.batching import DEFAULT
from canteen.models import default_model_path
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from scheduler.cost import StepCostModel, chunk_keys

try:
    from worker.engine.runner import ModelRunner
    from worker.model.loader import LoadedModel, choose_dtype, load_model
except ImportError:  # revisions before worker/ was grouped (bench/revisions.py --base)
    from worker.loader import LoadedModel, choose_dtype, load_model  # type: ignore[no-redef]
    from worker.runner import ModelRunner  # type: ignore[no-redef]
try:
    from worker.model.loader import choose_quantization
except ImportError:  # revisions before --quantization auto: their default was none

    def choose_quantization(
        requested: str, path: str, fmt: str, device: torch.device, dtype: str = "auto"
    ) -> tuple[str, str]:
        return ("none" if requested == "auto" else requested), ""


BLOCK = 16
MAX_BATCHED = 2048


class GcClock:
    """CPU milliseconds the cyclic garbage collector has run so far (gc.callbacks; the
    collector runs on the thread that set it off, so that thread's CPU time, which a loaded
    host does not stretch)."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._started = (0, 0.0)  # the collecting thread, its CPU time then
        gc.callbacks.append(self._on)

    def _on(self, phase: str, _info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started = (thread, time.thread_time())
        elif self._started[0] == thread:  # one thread's clock at both ends
            self.ms += (time.thread_time() - self._started[1]) * 1e3


GC = GcClock()


def decode_ms(runner: ModelRunner, batch: int, steps: int) -> float:
    runner.reset()
    per = runner.blocks_for(32 + steps + 2)
    seqs = tuple(
        NewSequence(
            f"s{i}",
            tuple(range(10 + i, 42 + i)),
            Sampling(0.0),
            tuple(range(i * per, (i + 1) * per)),
        )
        for i in range(batch)
    )
    plan = StepPlan(0, seqs, tuple(ScheduledSequence(s.seq_id, 32) for s in seqs))
    runner.step(plan)
    times = []
    for step in range(1, steps + 2):
        started = time.perf_counter()
        runner.step(StepPlan(step, (), tuple(ScheduledSequence(s.seq_id, 1) for s in seqs)))
        if step > 1:  # the first decode step warms up
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def prefill_ms(runner: ModelRunner, prompt: int) -> float:
    runner.reset()
    ids = tuple(100 + (i * 37) % 20000 for i in range(prompt))
    blocks = tuple(range(runner.blocks_for(prompt + 1)))
    new = NewSequence("p", ids, Sampling(0.0), blocks)
    started = time.perf_counter()
    done, step = 0, 0
    while done < prompt:
        n = min(MAX_BATCHED, prompt - done)
        runner.step(StepPlan(step, (new,) if step == 0 else (), (ScheduledSequence("p", n),)))
        done, step = done + n, step + 1
    return (time.perf_counter() - started) * 1e3


def stream_tokens(prompt: int, chunk: int) -> int:
    """Tokens each decoding stream may reach while the prompt is prefilled (chunk 0: sized
    by the cost model, one token a step at worst)."""
    return 64 + (prompt // chunk if chunk else prompt) * 17 // 16 + 24


def interference_steps(
    runner: ModelRunner,
    prompt: int,
    chunk: int,
    cost: StepCostModel,
    blind: bool = False,
    decode_every: int = 0,
) -> list[dict[str, float]]:
    """8 decodes per step; after 8 decode-only steps a ``prompt``-token prompt joins in
    ``chunk``-token chunks, or (chunk 0) in chunks the scheduler's cost model sizes from
    these steps' CPU times (``blind``: not told which steps were decode-only, the model
    before it kept them apart). One record per step: the chunk's position (-1: none), ms.
    ``decode_every`` N: every N steps also a decode-only step the model does not see (the
    scheduler sees none while a prompt is prefilled), and each chunk step's ``over_decode``
    is its CPU time over the latest such step's: the streams' contexts grow with every step
    here, so the decode steps before the prompt stop being the yardstick."""
    runner.reset()
    per = runner.blocks_for(stream_tokens(prompt, chunk))
    seqs = tuple(
        NewSequence(
            f"s{i}",
            tuple(range(10 + i, 42 + i)),
            Sampling(0.0),
            tuple(range(i * per, (i + 1) * per)),
        )
        for i in range(8)
    )
    runner.step(StepPlan(0, seqs, tuple(ScheduledSequence(s.seq_id, 32) for s in seqs)))
    ids = tuple(100 + (i * 37) % 20000 for i in range(prompt))
    first = 8 * per
    long = NewSequence(
        "p", ids, Sampling(0.0), tuple(range(first, first + runner.blocks_for(prompt + 1)))
    )
    records: list[dict[str, float]] = []
    done, step, context = -8, 1, 32
    decode_cpu = 0.0
    while done < prompt:
        if decode_every and done >= 0 and step % decode_every == 0:
            started = time.process_time()
            only = tuple(ScheduledSequence(s.seq_id, 1) for s in seqs)
            runner.step(StepPlan(step, (), only))
            decode_cpu, step, context = time.process_time() - started, step + 1, context + 1
        items = [ScheduledSequence(s.seq_id, 1) for s in seqs]
        new: tuple[NewSequence, ...] = ()
        decode_keys = 8 * (context + 1)
        size = chunk or cost.prefill_budget(8, 1, 8, max(done, 0), decode_keys)
        bound = getattr(cost, "bound_seconds", None) if not chunk and done >= 0 else None
        n = min(size, prompt - done) if done >= 0 else 0
        if n:
            items.append(ScheduledSequence("p", n))
            new = (long,) if done == 0 else ()
        wall, cpu, collected = time.perf_counter(), time.process_time(), GC.ms
        result = runner.step(StepPlan(step, new, tuple(items)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if result.failed:
            raise RuntimeError(f"step {step} refused: {result.failed}")
        told = None if blind else n == 0  # the batcher tells decode-only steps apart
        cost.observe(8 + n, cpu, decode_keys + chunk_keys(n, max(done, 0)), told)
        records.append(
            {
                "pos": done if n else -1,
                "n": n,
                "wall_ms": wall * 1e3,
                "cpu_ms": cpu * 1e3,
                "gc_ms": GC.ms - collected,
                # the step's CPU time over the time the cost model held it to
                "over_bound": cpu / bound if bound else 0.0,
                "over_decode": cpu / decode_cpu if decode_cpu and n else 0.0,
            }
        )
        done, step, context = (done + n if n else done + 1), step + 1, context + 1
    return records


def attention_ms(loaded: LoadedModel, position: int) -> dict[str, float]:
    """CPU ms of one layer's attention kernel (worker/kernels/attention.cpp) alone, as a step
    calls it: 8 decode rows over 200 keys each, and chunks of 16, 64 and 256 rows after
    ``position`` cached tokens (each row over its own keys, in place: no mask, no gather)."""
    from worker import kernels

    if not kernels.available():
        return {}
    kv_heads, dim = loaded.num_kv_heads, loaded.head_dim
    heads = loaded.model.config.num_attention_heads
    pool = torch.randn(2, kv_heads, position + 256 + 8 * 256, dim).to(loaded.dtype)

    def timed(
        rows: int, slots: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor | None
    ) -> float:
        q = torch.randn(rows, heads, dim).to(loaded.dtype)
        out = q.new_empty(rows, heads * dim)
        args = (out, q, pool, slots, lens, torch.arange(rows), dim**-0.5, tables)
        torch.ops.canteen.paged_decode_into(*args)  # warm-up
        reps = max(2, 512 // rows)
        started = time.thread_time()
        for _ in range(reps):
            torch.ops.canteen.paged_decode_into(*args)
        return (time.thread_time() - started) / reps * 1e3

    first = position + 256
    decode = torch.arange(first, first + 8 * 256).view(8, 256)
    out = {"decode 8 x 200 keys": timed(8, decode, torch.full((8,), 200), None)}
    for n in (16, 64, 256):
        lens = torch.arange(position + 1, position + n + 1)
        slots = torch.arange(position + n).view(1, -1)
        out[f"chunk {n} at {position}"] = timed(n, slots, lens, torch.zeros(n, dtype=torch.long))
    return out


def warmup() -> dict[str, int]:
    """The cost model's warm-up argument, in trees that have one."""
    try:
        from scheduler.cost import WARMUP_STEPS
    except ImportError:
        return {}
    return {"warmup_steps": WARMUP_STEPS}


def make_runner(loaded: LoadedModel, num_blocks: int) -> ModelRunner:
    """The runner as this tree builds it, or as revisions before RunnerConfig did (the base
    of bench/revisions.py may be either)."""
    try:
        from worker.engine.runner import RunnerConfig
    except ImportError:  # before RunnerConfig, or before worker/ was grouped
        return ModelRunner(loaded, num_blocks, BLOCK, max_batched_tokens=MAX_BATCHED)  # type: ignore[arg-type]
    return ModelRunner(loaded, RunnerConfig(num_blocks, BLOCK, max_batched_tokens=MAX_BATCHED))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--quantization", default="auto", help="as the worker's flag (auto: its default)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--interference", type=int, help="chunk size, 0: sized by the cost model (see above)"
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="--interference: every step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--blind-cost",
        action="store_true",
        help="--interference 0: do not tell the cost model which steps were decode-only",
    )
    parser.add_argument(
        "--no-freeze", action="store_true", help="leave the model's objects to the collector"
    )
    parser.add_argument(
        "--decode-every",
        type=int,
        default=0,
        help="--interference: a decode-only yardstick step every N steps (see above)",
    )
    parser.add_argument(
        "--attention", type=int, help="time the attention kernel alone at this position"
    )
    parser.add_argument(
        "--max-stall",
        type=float,
        default=DEFAULT.max_step_stall,
        help="--interference 0: the cost model's bound (default: the scheduler's)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    path = str(default_model_path())
    quantization, _ = choose_quantization(args.quantization, path, "gguf", device, args.dtype)
    dtype, _ = choose_dtype(args.dtype, device, quantization)
    loaded = load_model(path, "gguf", "", device, dtype, False, quantization=quantization)
    batches = [int(b) for b in args.batches.split(",")]
    num_blocks = max(max(batches) * 4, -(-args.prompt // BLOCK) + 2)
    if args.attention is not None:
        print(json.dumps(attention_ms(loaded, args.attention)))
        return
    if args.interference is not None:  # 8 decoding sequences beside the prompt
        num_blocks += 8 * (-(-stream_tokens(args.prompt, args.interference) // BLOCK))
    runner = make_runner(loaded, num_blocks)
    if not args.no_freeze:  # what canteen/heap.py does once a worker is ready
        gc.collect()
        gc.freeze()
    out: dict[str, float] = {}
    if args.interference is not None:
        # the scheduler's defaults; like the scheduler, skip a fresh worker's first steps
        cost = StepCostModel(max_stall=args.max_stall, min_chunk=16, **warmup())
        with torch.inference_mode():
            for _ in range(args.repeat):
                records = interference_steps(
                    runner,
                    args.prompt,
                    args.interference,
                    cost,
                    args.blind_cost,
                    args.decode_every,
                )
                only = [r["cpu_ms"] for r in records if r["n"] == 0]
                chunks = [r["cpu_ms"] for r in records if r["n"]]
                decode = statistics.median(only)
                print(
                    json.dumps(
                        {
                            "decode_only_median_wall_ms": statistics.median(
                                r["wall_ms"] for r in records if r["n"] == 0
                            ),
                            "decode_only_median_cpu_ms": decode,
                            "steps_with_a_chunk": len(chunks),
                            "worst_chunk_step_cpu_over_decode": max(chunks) / decode,
                            "p90_chunk_step_cpu_over_decode": sorted(chunks)[len(chunks) * 9 // 10]
                            / decode,
                            "p99_chunk_step_cpu_over_decode": sorted(chunks)[
                                len(chunks) * 99 // 100
                            ]
                            / decode,
                            "worst_step_gc_ms": max(r["gc_ms"] for r in records),
                            "worst_chunk_step_over_bound": max(r["over_bound"] for r in records),
                            "p90_chunk_step_over_bound": sorted(
                                r["over_bound"] for r in records if r["n"]
                            )[len(chunks) * 9 // 10],
                            "num_reanchored": getattr(cost, "num_reanchored", 0),
                            "worst_chunk_step_over_decode_beside": max(
                                r["over_decode"] for r in records
                            ),
                            "p90_chunk_step_over_decode_beside": sorted(
                                r["over_decode"] for r in records if r["n"]
                            )[len(chunks) * 9 // 10],
                            "steps_with_gc_over_20ms": sum(r["gc_ms"] > 20 for r in records),
                        }
                    )
                )
                for r in records:
                    if r["n"] and args.verbose:
                        print(json.dumps(r))
        return
    with torch.inference_mode():
        prefill_ms(runner, 64)  # warm-up
        for batch in batches:
            out[f"decode@{batch}"] = decode_ms(runner, batch, args.steps)
        out[f"prefill {args.prompt}"] = prefill_ms(runner, args.prompt)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
