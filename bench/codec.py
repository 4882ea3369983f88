"""Times the codec (canteen/codec/step.py) against hand-written positional conversion.

The worker contract runs once per step on both sides of every worker link: the scheduler
encodes a plan and decodes a result, the worker the reverse. For a 64-sequence plan (all
decoding, or all new) and a 64-token result, each conversion is timed for the codec and for
the baseline below (the code the codec replaced, written field by field), both warm,
alternating in every round, with the order inside a round swapped each round. Prints the
median microseconds per call of each and the ratio codec/baseline (<= 1.0: the codec is at
least as fast). Both must encode to the same bytes, which is checked first.

    PYTHONPATH=. python bench/codec.py [--rounds 30] [--calls 200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from canteen.codec import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from canteen.codec.sampling import sampling_from_pb, sampling_to_pb
from canteen.plan import (
    FailedSequence,
    NewSequence,
    SampledToken,
    Sampling,
    ScheduledSequence,
    StepPlan,
    StepResult,
)
from canteen.v1 import common_pb2, worker_pb2


def base_plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=plan.step_id,
        new_sequences=[
            worker_pb2.NewSequence(
                seq_id=n.seq_id,
                token_ids=n.token_ids,
                sampling=sampling_to_pb(n.sampling),
                block_ids=n.block_ids,
                num_cached_tokens=n.num_cached_tokens,
                traceparent=n.traceparent,
                request_id=n.request_id,
                num_prompt_tokens=n.num_prompt_tokens,
            )
            for n in plan.new_sequences
        ],
        scheduled=[
            worker_pb2.ScheduledSequence(
                seq_id=s.seq_id,
                num_tokens=s.num_tokens,
                new_block_ids=s.new_block_ids,
                num_draft_tokens=s.num_draft_tokens,
            )
            for s in plan.scheduled
        ],
        dropped_seq_ids=plan.dropped_seq_ids,
    )


def base_plan_from_pb(msg: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        msg.step_id,
        tuple(
            NewSequence(
                n.seq_id,
                tuple(n.token_ids),
                sampling_from_pb(n.sampling),
                tuple(n.block_ids),
                n.num_cached_tokens,
                n.traceparent,
                n.request_id,
                n.num_prompt_tokens,
            )
            for n in msg.new_sequences
        ),
        tuple(
            ScheduledSequence(s.seq_id, s.num_tokens, tuple(s.new_block_ids), s.num_draft_tokens)
            for s in msg.scheduled
        ),
        tuple(msg.dropped_seq_ids),
    )


def base_result_to_pb(result: StepResult) -> worker_pb2.StepResult:
    return worker_pb2.StepResult(
        step_id=result.step_id,
        tokens=[
            worker_pb2.SampledToken(
                seq_id=t.seq_id,
                token_id=t.token_id,
                logprob=t.logprob,
                top=common_pb2.TopLogprobs(
                    token_ids=[i for i, _ in t.top], logprobs=[lp for _, lp in t.top]
                )
                if t.top
                else None,
            )
            for t in result.tokens
        ],
        num_tokens=result.num_tokens,
        timings=worker_pb2.StepTimings(
            forward_ns=result.forward_ns, sample_ns=result.sample_ns, total_ns=result.total_ns
        ),
        failed=[
            worker_pb2.SequenceFailure(
                seq_id=f.seq_id, error=f.error, is_request_error=f.is_request_error
            )
            for f in result.failed
        ],
        num_draft_tokens=result.num_draft_tokens,
        num_accepted_tokens=result.num_accepted_tokens,
        num_proposed=result.num_proposed,
    )


def base_result_from_pb(msg: worker_pb2.StepResult) -> StepResult:
    return StepResult(
        msg.step_id,
        tuple(
            SampledToken(
                t.seq_id,
                t.token_id,
                t.logprob,
                tuple(zip(t.top.token_ids, t.top.logprobs, strict=True)),
            )
            for t in msg.tokens
        ),
        msg.num_tokens,
        msg.timings.forward_ns,
        msg.timings.sample_ns,
        msg.timings.total_ns,
        tuple(FailedSequence(f.seq_id, f.error, f.is_request_error) for f in msg.failed),
        msg.num_draft_tokens,
        msg.num_accepted_tokens,
        dict(msg.num_proposed),
    )


def examples() -> tuple[StepPlan, StepPlan, StepResult]:
    """A 64-sequence decoding plan, a plan of 64 new sequences, a 64-token result."""
    decoding = StepPlan(
        7, scheduled=tuple(ScheduledSequence(f"seq-{i}", 1, (100 + i,)) for i in range(64))
    )
    new = StepPlan(
        8,
        new_sequences=tuple(
            NewSequence(
                f"seq-{i}",
                tuple(range(i, i + 32)),
                Sampling(0.5, 0.75, 40, seed=i),  # exact in float32
                (2 * i, 2 * i + 1),
                request_id=f"req-{i}",
                num_prompt_tokens=32,
            )
            for i in range(64)
        ),
    )
    result = StepResult(
        7,
        tokens=tuple(SampledToken(f"seq-{i}", 1000 + i, -0.5) for i in range(64)),
        num_tokens=64,
        forward_ns=1_000_000,
        sample_ns=20_000,
        total_ns=1_100_000,
    )
    return decoding, new, result


Fn = Callable[[Any], Any]
Case = tuple[Fn, Fn, Any]


def cases() -> dict[str, Case]:
    """name -> (codec, baseline, argument); refuses to time a pair that disagrees."""
    decoding, new, result = examples()
    out: dict[str, Case] = {}
    plan: tuple[Fn, Fn, Fn, Fn] = (plan_to_pb, base_plan_to_pb, plan_from_pb, base_plan_from_pb)
    step: tuple[Fn, Fn, Fn, Fn] = (
        result_to_pb,
        base_result_to_pb,
        result_from_pb,
        base_result_from_pb,
    )
    rows: list[tuple[str, Any, tuple[Fn, Fn, Fn, Fn]]] = [
        ("plan 64 decoding", decoding, plan),
        ("plan 64 new", new, plan),
        ("result 64 tokens", result, step),
    ]
    for name, value, (encode, base_encode, decode, base_decode) in rows:
        mine = encode(value)
        if mine.SerializeToString() != base_encode(value).SerializeToString():
            raise SystemExit(f"{name}: the codec and the baseline encode different bytes")
        if decode(mine) != value or base_decode(mine) != value:
            raise SystemExit(f"{name}: a decode does not give back the original")
        out[f"encode {name}"] = (encode, base_encode, value)
        out[f"decode {name}"] = (decode, base_decode, mine)
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def per_call_us(fn: Callable[[Any], Any], arg: Any, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(arg)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200, help="calls per timing")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    print(f"{'conversion':<28}{'codec us':>10}{'baseline us':>13}{'ratio':>8}")
    for name, (codec, base, arg) in cases().items():
        per_call_us(codec, arg, args.calls)  # warm both
        per_call_us(base, arg, args.calls)
        times: dict[str, list[float]] = {"codec": [], "base": []}
        for r in range(args.rounds):
            order = [("codec", codec), ("base", base)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                times[label].append(per_call_us(fn, arg, args.calls))
        mine, theirs = statistics.median(times["codec"]), statistics.median(times["base"])
        print(f"{name:<28}{mine:>10.1f}{theirs:>13.1f}{mine / theirs:>8.2f}")


if __name__ == "__main__":
    main()
