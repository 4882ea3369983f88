"""Drives a ModelRunner through a mix of sequences as a scheduler would: staggered arrivals,
chunked prefills, prefix-cache hits on another sequence's blocks, and preemption by
recompute, so tests can compare every sequence's greedy tokens and logprobs with the same
sequence served alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from worker.engine.runner import ModelRunner

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


def run_mix(
    runner: ModelRunner, arrivals: list[Arrival], drafts: int = 0, max_steps: int = 10_000
) -> dict[str, Sampled]:
    """Every arrival's greedy (token, logprob) pairs, the mix run in one runner; ``drafts``:
    the draft tokens each decoding sequence may verify per step (speculation)."""
    runner.reset()
    bs, pool = runner.block_size, _Blocks()
    waiting = sorted(arrivals, key=lambda a: a.at_step)
    live: dict[str, _Live] = {}
    started: dict[str, _Live] = {}  # every sequence so far: a finished one's blocks stay cached
    done: dict[str, Sampled] = {}
    drops: list[str] = []
    for step in range(max_steps):
        new: list[NewSequence] = []
        for a in list(waiting):
            donor = started.get(a.cached_from or "")
            if a.at_step > step or (
                a.cached_from and (donor is None or donor.computed < a.num_cached)
            ):
                continue
            waiting.remove(a)
            shared = donor.blocks[: a.num_cached // bs] if donor else ()
            total = runner.blocks_for(len(a.prompt) + a.new)
            seq = _Live(
                a,
                shared + pool.take(total - len(shared)),
                list(a.prompt),
                computed=len(shared) * bs,
            )
            live[a.seq_id] = started[a.seq_id] = seq
            new.append(
                NewSequence(a.seq_id, tuple(a.prompt), Sampling(0.0), seq.blocks, seq.computed)
            )
        for seq in live.values():  # a preempted sequence comes back with what it generated
            if seq.preempted and seq.arrival.seq_id not in drops:
                seq.preempted, seq.computed = False, 0
                seq.blocks = pool.take(len(seq.blocks))
                prompt = len(seq.arrival.prompt)
                new.append(
                    NewSequence(
                        seq.arrival.seq_id,
                        tuple(seq.tokens),
                        Sampling(0.0),
                        seq.blocks,
                        0,
                        num_prompt_tokens=prompt,
                    )
                )
        scheduled = [_schedule(s, drafts) for s in live.values() if not s.preempted]
        if not scheduled and not waiting and not drops:
            return done
        result = runner.step(StepPlan(step, tuple(new), tuple(scheduled), tuple(drops)))
        assert not result.failed, result.failed
        drops = []
        for item in scheduled:
            live[item.seq_id].computed += item.num_tokens
        for token in result.tokens:
            got = live.get(token.seq_id)
            if got is None or got.preempted:
                continue  # past its last token (drafts verified beyond ``new``)
            seq = got
            seq.out.append((token.token_id, token.logprob))
            seq.tokens.append(token.token_id)
            seq.computed = len(seq.tokens) - 1  # verified drafts are computed too
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


def _schedule(seq: _Live, drafts: int) -> ScheduledSequence:
    left = len(seq.tokens) - seq.computed
    if left > 1:
        return ScheduledSequence(seq.arrival.seq_id, min(left, seq.arrival.chunk))
    room = seq.arrival.new - len(seq.out) - 1  # drafts past the last token are wasted
    return ScheduledSequence(seq.arrival.seq_id, 1, num_draft_tokens=max(min(drafts, room), 0))


def alone(runner: ModelRunner, arrival: Arrival) -> Sampled:
    """The arrival served by itself: the whole prompt in one step, nothing cached."""
    solo = Arrival(arrival.seq_id, arrival.prompt, arrival.new, chunk=len(arrival.prompt))
    return run_mix(runner, [solo])[arrival.seq_id]
