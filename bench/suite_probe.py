"""Where a suite step's time goes: the worker's own step time against the step as the
scheduler sees it and the wall time per step, with each service's CPU seconds.

Starts the suite on SmolLM2 (the worker on ``--device auto``: CUDA where present), runs
``--streams`` concurrent greedy requests through the gateway, and reads the worker's and the
scheduler's step histograms before and after each run. Prints one JSON line per run:

    worker_ms     the worker's step (forward and sampling), mean over decode steps
    worker_cpu_ms the engine thread's CPU in those steps (below worker_ms: descheduled, or
                  waiting for torch's other threads)
    idle_plan_ms  per decode step, the engine idle while its plan had not arrived (waiting on
                  the scheduler); idle_handoff_ms from the plan's arrival to the step's start
    scheduler_ms  plan sent to result read, mean over decode steps (pipelined: overlaps)
    wall_ms       the run's wall time over its decode steps
    prefill_*     steps that computed prompt tokens: how many, and the worker's seconds
    cpu_s         CPU seconds each process used during the run
    thread_us     per process, each thread's CPU microseconds per generated token (threads
                  under 1 µs left out), keyed ``name:tid`` (``main``: the first thread)

Usage: python bench/suite_probe.py [--streams 1,16] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import NicedClient, questions
from tests.support.suite import Stack, Suite, default_model_stack, wait_serving

WORKER = "canteen_worker_step_duration_seconds"
WORKER_CPU = "canteen_worker_step_cpu_seconds"
IDLE = "canteen_worker_idle_seconds"
SCHEDULER = "canteen_step_duration_seconds"


def histogram(url: str, name: str) -> dict[str, float]:
    """{"decode_sum", "decode_count", "prefill_sum", "prefill_count"} of histogram ``name``
    at a /metrics ``url``."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {f"{k}_{p}": 0.0 for k in ("decode", "prefill") for p in ("sum", "count")}
    for line in text.splitlines():
        for kind in ("decode", "prefill"):
            for part in ("sum", "count"):
                if line.startswith(f"{name}_{part}{{") and f'kind="{kind}"' in line:
                    out[f"{kind}_{part}"] += float(line.rsplit(" ", 1)[1])
    return out


def label_sums(url: str, name: str, label: str) -> dict[str, float]:
    """The ``_sum`` of histogram ``name`` per value of ``label`` at a /metrics ``url``."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(f"{name}_sum{{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def thread_seconds(stack: Stack) -> dict[str, dict[str, float]]:
    """Each service's threads and their CPU seconds, keyed ``name:tid``: ``main`` for the
    process's first thread (the asyncio loop of the scheduler and gateway, the worker's
    forward), else the name in /proc (grpc's ``event_engine``; Python threads are ``python``)."""
    out: dict[str, dict[str, float]] = {}
    for name in ("scheduler", "worker", "gateway"):
        process = psutil.Process(getattr(stack, name).process.pid)
        threads: dict[str, float] = {}
        for t in process.threads():
            comm = Path(f"/proc/{process.pid}/task/{t.id}/comm")
            try:
                label = "main" if t.id == process.pid else comm.read_text().strip()
            except OSError:  # the thread ended
                continue
            threads[f"{label}:{t.id}"] = t.user_time + t.system_time
        out[name] = threads
    return out


def cpu_seconds(stack: Stack) -> dict[str, float]:
    services = {
        "registry": stack.registry,
        "scheduler": stack.scheduler,
        "worker": stack.worker,
        "gateway": stack.gateway,
    }
    return {
        name: sum(psutil.Process(s.process.pid).cpu_times()[:2]) for name, s in services.items()
    }


def probe(stack: Stack, client: NicedClient, streams: int, tokens: int, tag: str) -> dict:
    urls = (stack.worker.metrics_url, stack.scheduler.metrics_url)
    before = [histogram(u, n) for u, n in zip(urls, (WORKER, SCHEDULER), strict=True)]
    threads_before = thread_seconds(stack)
    engine_before = engine_sums(stack.worker.metrics_url)
    cpu, started = cpu_seconds(stack), time.perf_counter()
    tps = client.run(stack.gateway.address, questions(streams, tag), tokens)
    wall = time.perf_counter() - started
    after = [histogram(u, n) for u, n in zip(urls, (WORKER, SCHEDULER), strict=True)]
    used = cpu_seconds(stack)
    threads_after = thread_seconds(stack)
    engine = engine_sums(stack.worker.metrics_url)
    (w0, s0), (w1, s1) = before, after
    steps = max(w1["decode_count"] - w0["decode_count"], 1)
    seen = max(s1["decode_count"] - s0["decode_count"], 1)
    return {
        "streams": streams,
        "tok_s": round(tps, 1),
        "decode_steps": int(steps),
        "worker_ms": round(1e3 * (w1["decode_sum"] - w0["decode_sum"]) / steps, 2),
        **{k: round(1e3 * (v - engine_before.get(k, 0.0)) / steps, 3) for k, v in engine.items()},
        "scheduler_ms": round(1e3 * (s1["decode_sum"] - s0["decode_sum"]) / seen, 2),
        "wall_ms": round(1e3 * wall / steps, 2),
        "prefill_steps": int(w1["prefill_count"] - w0["prefill_count"]),
        "prefill_s": round(w1["prefill_sum"] - w0["prefill_sum"], 3),
        "wall_s": round(wall, 3),
        "cpu_s": {k: round(used[k] - cpu[k], 2) for k in used},
        "thread_us": per_token(threads_before, threads_after, streams * tokens),
    }


def engine_sums(url: str) -> dict[str, float]:
    cpu = label_sums(url, WORKER_CPU, "kind").get("decode", 0.0)
    idle = label_sums(url, IDLE, "cause")
    return {"worker_cpu_ms": cpu, **{f"idle_{k}_ms": v for k, v in idle.items()}}


def per_token(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], tokens: int
) -> dict[str, dict[str, int]]:
    """CPU microseconds per token of each thread that used at least 1 µs a token, busiest
    first. Linux counts thread CPU in 10 ms ticks: run enough tokens for them to resolve."""
    out = {}
    for service, threads in after.items():
        used = {t: 1e6 * (s - before[service].get(t, 0.0)) / tokens for t, s in threads.items()}
        busiest = sorted(used.items(), key=lambda item: -item[1])
        out[service] = {t: round(us) for t, us in busiest if us >= 1}
    return out


@contextlib.contextmanager
def tiny_stack(
    workdir: Path,
    worker_args: list[str],
    scheduler_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """The suite on a tiny random llama (tests/support/tiny_model.py)."""
    from tests.support.tiny_model import build_tiny_model

    suite = Suite(workdir)
    try:
        registry = suite.start_tiny_registry(build_tiny_model(workdir / "tiny"))
        scheduler = suite.start_scheduler(registry, *scheduler_args)
        worker = suite.start_worker(registry, "tiny", *worker_args)
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 120, role="scheduler")
        gateway = suite.start_gateway(registry, scheduler, *gateway_args)
        yield Stack(registry, scheduler, worker, gateway)
    finally:
        suite.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker-args", default="", help="extra worker flags, space-separated")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random model instead of SmolLM2: steps of about a millisecond, the "
        "regime of a GPU worker, where the edge services bound the suite",
    )
    args = parser.parse_args()
    worker_args = ["--kv-cache-memory", "1GiB", "--dtype", "auto", *args.worker_args.split()]
    with tempfile.TemporaryDirectory() as tmp:
        stacks = tiny_stack if args.tiny else default_model_stack
        with stacks(Path(tmp), worker_args=worker_args) as stack:
            client = NicedClient()
            client.run(stack.gateway.address, questions(2, "warm"), 8)
            for r in range(args.rounds):
                for streams in (int(s) for s in args.streams.split(",")):
                    found = probe(stack, client, streams, args.tokens, f"r{r}")
                    print(json.dumps(found), flush=True)
            client.close()


if __name__ == "__main__":
    main()
