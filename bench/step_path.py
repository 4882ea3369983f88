"""The scheduler's per-token Python in-process: batcher, worker codec and shared-stream batch.

For ``--streams`` decoding sequences of ``--tokens`` tokens each, runs the scheduler's side of
every step as the worker link does (schedule, encode and serialize the plan; parse and
decode the result, update, deliver the events to subscription sinks, build and serialize
the shared-stream batch) with a fake worker that answers every plan with one token per
sequence. Only the scheduler's side is timed, in thread CPU time (not wall time), so a
loaded host changes the figure less than an end-to-end run. No gRPC, no sockets: this is
the part of ``bench/shared_stream.py``'s scheduler CPU that code in scheduler/ and
canteen/codec/ decides. Prints the median and minimum microseconds per token over
``--rounds`` runs. To compare two trees, run it from each alternately:

    PYTHONPATH=. python bench/step_path.py [--streams 32] [--tokens 64] [--interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from canteen.batching import BatchConfig
from canteen.codec import batch_to_pb, plan_to_pb, result_from_pb
from canteen.logging import configure_logging
from canteen.plan import Sampling
from canteen.v1 import worker_pb2
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.sequence import Sequence
from scheduler.subscriptions import Subscription, TokenSink


def fake_result(plan: bytes, step: int) -> bytes:
    """The worker's answer to a serialized plan: one token for every scheduled sequence."""
    msg = worker_pb2.StepPlan.FromString(plan)
    result = worker_pb2.StepResult(step_id=msg.step_id, num_tokens=len(msg.scheduled))
    for scheduled in msg.scheduled:
        result.tokens.add(seq_id=scheduled.seq_id, token_id=1000 + step % 7, logprob=-0.5)
    result.timings.total_ns = 1_000_000
    return result.SerializeToString()


async def one_run(streams: int, tokens: int, interval: int) -> tuple[float, int]:
    """Thread CPU seconds of the scheduler's side, and tokens made."""
    core = BatchScheduler(BlockPool(8192, 16), BatchConfig(max_batched_tokens=2048))
    subscription = Subscription("peer")
    sinks: dict[str, TokenSink] = {}
    for i in range(streams):
        seq = Sequence(
            request_id=f"r{i}",
            prompt_ids=list(range(100 + i, 130 + i)),
            max_tokens=tokens,
            sampling=Sampling(0.0),
        )
        sinks[seq.seq_id] = subscription.attach(i + 1, seq, asyncio.Queue(), interval)
        core.add(seq, "w")
    cpu, made, step = 0.0, 0, 0
    in_flight: list[bytes] = []
    while True:
        began = time.thread_time()
        while (plan := core.schedule()) is not None:
            in_flight.append(plan_to_pb(plan).SerializeToString())
        cpu += time.thread_time() - began
        if not in_flight:
            return cpu, made
        answer = fake_result(in_flight.pop(0), step)
        step += 1
        began = time.thread_time()
        result = result_from_pb(worker_pb2.StepResult.FromString(answer))
        for event in core.update(result):
            made += len(event.token_ids)
            sinks[event.seq_id].put_nowait(event)
        if subscription.has_pending:
            batch_to_pb(await subscription.next_batch()).SerializeToString()
        cpu += time.thread_time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--interval", type=int, default=1, help="the stream interval")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    configure_logging("scheduler")
    per_token = []
    for _ in range(args.rounds):
        cpu, made = asyncio.run(one_run(args.streams, args.tokens, args.interval))
        assert made == args.streams * args.tokens, made
        per_token.append(1e6 * cpu / made)
    print(
        f"streams={args.streams} interval={args.interval} scheduler step path: "
        f"median {statistics.median(per_token):.2f} us/token, min {min(per_token):.2f}"
    )


if __name__ == "__main__":
    main()
