"""Drives a ModelRunner through a mix of sequences as a scheduler would: staggered arrivals,
chunked prefills, prefix-cache hits on another sequence's blocks, and preemption by
recompute, so tests can compare every sequence's greedy tokens and logprobs with the same
sequence served alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from worker.runner import ModelRunner

Sampled = list[tuple[int, float]]  # (token id, its logprob) per generated token


@dataclass(frozen=True)
class Arrival:
    """One sequence of a mix: ``prompt`` joins at step ``at_step`` and generates ``new``
    tokens, its prefill ``chunk`` tokens a step. ``cached_from`` names an earlier sequence
    whose first ``num_cached`` prompt tokens (whole blocks) it shares and reuses from the
    pool. ``preempt_after``: dropped once it has that many tokens, then recomputed."""

    seq_id: str
    prompt: tuple[int, ...]
    new: int
    chunk: int
    at_step: int = 0
    cached_from: str | None = None
    num_cached: int = 0
    preempt_after: int = 0


@dataclass
class _Live:
    arrival: Arrival
    blocks: tuple[int, ...]
    tokens: list[int]  # prompt, then what it generated
    computed: int = 0  # tokens whose KV is in the pool
    out: Sampled = field(default_factory=list)
    preempted: bool = False


class _Blocks:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        first, self.next = self.next, self.next + n
        return tuple(range(first, self.next))


def run_mix(runner: ModelRunner, arrivals: list[Arrival], max_steps: int = 10_000) -> dict[str, Sampled]:
    """Every arrival's greedy (token, logprob) pairs, the mix run in one runner."""
    runner.reset()
    bs, pool = runner.block_size, _Blocks()
    waiting = sorted(arrivals, key=lambda a: a.at_step)
    live: dict[str, _Live] = {}
    done: dict[str, Sampled] = {}
    drops: list[str] = []
    for step in range(max_steps):
        new: list[NewSequence] = []
        for a in list(waiting):
            donor = live.get(a.cached_from or "")
            if a.at_step > step or (a.cached_from and (donor is None or donor.computed < a.num_cached)):
                continue
            waiting.remove(a)
            shared = donor.blocks[: a.num_cached // bs] if donor else ()
            total = runner.blocks_for(len(a.prompt) + a.new)
            seq = _Live(a, shared + pool.take(total - len(shared)), list(a.prompt), computed=len(shared) * bs)
            live[a.seq_id] = seq
            new.append(NewSequence(a.seq_id, tuple(a.prompt), Sampling(0.0), seq.blocks, seq.computed))
        for seq in live.values():  # a preempted sequence comes back with what it generated
            if seq.preempted and seq.arrival.seq_id not in drops:
                seq.preempted, seq.computed = False, 0
                seq.blocks = pool.take(len(seq.blocks))
                prompt = len(seq.arrival.prompt)
                new.append(NewSequence(seq.arrival.seq_id, tuple(seq.tokens), Sampling(0.0), seq.blocks, 0, num_prompt_tokens=prompt))
        scheduled = [
            ScheduledSequence(s.arrival.seq_id, _tokens_this_step(s))
            for s in live.values()
            if not s.preempted
        ]
        if not scheduled and not waiting and not drops:
            return done
        result = runner.step(StepPlan(step, tuple(new), tuple(scheduled), tuple(drops)))
        assert not result.failed, result.failed
        drops = []
        for item in scheduled:
            live[item.seq_id].computed += item.num_tokens
        for token in result.tokens:
            seq = live[token.seq_id]
            seq.out.append((token.token_id, token.logprob))
            seq.tokens.append(token.token_id)
            a = seq.arrival
            if len(seq.out) == a.new:
                done[token.seq_id] = seq.out
                del live[token.seq_id]
                drops.append(token.seq_id)
            elif a.preempt_after and len(seq.out) == a.preempt_after and not seq.preempted:
                seq.preempted = True
                drops.append(token.seq_id)
                seq.arrival = Arrival(**{**a.__dict__, "preempt_after": 0})
    raise AssertionError(f"the mix did not finish in {max_steps} steps")


def _tokens_this_step(seq: _Live) -> int:
    left = len(seq.tokens) - seq.computed
    return min(left, seq.arrival.chunk) if left > 1 else 1


def alone(runner: ModelRunner, arrival: Arrival) -> Sampled:
    """The arrival served by itself: the whole prompt in one step, nothing cached."""
    solo = Arrival(arrival.seq_id, arrival.prompt, arrival.new, chunk=len(arrival.prompt))
    return run_mix(runner, [solo])[arrival.seq_id]
