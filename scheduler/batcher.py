"""Continuous batching for one worker: ``schedule()`` builds a step plan, ``update()`` applies
the worker's result.

Each step, under a token budget and a cap on running sequences:

    1. decode: every running sequence with one token to compute gets it
    2. prefill chunks of running sequences that are still reading their prompt; while
       sequences decode, prefill is also held to what keeps the step within
       ``max_step_stall`` decode-only steps (scheduler/cost.py), for the sake of the
       streams that were streaming before the held prompts arrived
    3. admission: waiting sequences (highest priority first, then oldest) while their
       next chunk's blocks plus a watermark are free; a sequence whose LoRA adapter is not
       in the running batch waits while the batch already mixes ``max_loras`` adapters,
       and one the worker must load first takes its load's share of the budget

When a running sequence needs a block and none is free, the lowest-priority, most recently
admitted sequence not yet in this step is preempted by recompute: its blocks are freed and it
waits at the front of the queue with its generated tokens kept, so its stream resumes exactly.
Sequences join and leave the batch between any two steps. Block tables change only through
the ``KVManager`` (scheduler/kv.py); which sequence gives its blocks up is decided here.

Pipelining (the next plan built while the worker computes the previous one) and plans that
verify drafts: scheduler/inflight.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable

from canteen.batching import BatchConfig
from canteen.finish import Finish
from canteen.logging import get_logger
from canteen.plan import NewSequence, SampledToken, ScheduledSequence, StepPlan, StepResult
from scheduler.blocks import BlockPool
from scheduler.cost import StepCostModel, chunk_keys
from scheduler.inflight import Ahead, Entry, InFlightSums
from scheduler.kv import KVManager
from scheduler.lora import adapter_load_tokens, admissible_waiting
from scheduler.sequence import SeqEvent, Sequence, Status
from scheduler.speculation import SpeculationPolicy
from scheduler.tiers import TierIndex
from scheduler.timing import observe_step

log = get_logger(__name__)


class BatchScheduler:
    def __init__(
        self,
        pool: BlockPool,
        limits: BatchConfig,
        num_draft_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int | None = None,
        tiers: TierIndex | None = None,
        cost_warmup_steps: int = 0,
    ) -> None:
        """``cost_warmup_steps``: the worker's first steps, which the cost model skips."""
        self.kv = KVManager(pool, limits.watermark_blocks, tiers)
        # Most distinct adapters in the running batch (so in any step); None: no limit.
        self.max_loras = max_loras
        # Ids of the adapters the worker holds loaded (its last StepResult that said).
        self.resident_adapters: frozenset[str] = frozenset()
        self._clock = clock
        self._last_result_at: float | None = None
        self.speculation = SpeculationPolicy(num_draft_tokens)
        self.limits = limits
        self.depth = limits.pipeline_depth  # plans in flight at once
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self._pending_drops: list[str] = []
        # Ids preempted since the link last took them: their held tokens go out now.
        self.preempted: list[str] = []
        self._in_flight: deque[tuple[StepPlan, dict[str, Entry]]] = deque()
        self._sums = InFlightSums()  # by seq_id: its entries above, summed
        self._admit_counter = 0
        self._ticks = 0  # results applied so far
        self.cost = (
            StepCostModel(limits.max_step_stall, limits.min_prefill_chunk, cost_warmup_steps)
            if limits.max_step_stall
            else None
        )

    # -- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence, worker_id: str = "") -> None:
        """Queues ``seq`` (new, or moved here from a lost worker) on worker ``worker_id``."""
        seq.worker_id = worker_id
        seq.status = Status.WAITING
        # A stream moved here mid-answer (failover) counts as streaming from its arrival.
        seq.arrival_tick = self._ticks
        seq.first_token_tick = self._ticks if seq.output_ids else None
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """Stops a sequence; its blocks are free before the next plan is built."""
        if seq.is_finished:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self._finish(seq, Finish.CANCELLED)
        elif self._in_flight:
            seq.is_cancel_requested = True  # freed when the step using its blocks returns
        else:
            self._finish(seq, Finish.CANCELLED)

    def evict_all(self) -> list[Sequence]:
        """Takes every unfinished sequence off this worker (it is lost), ready to run again
        elsewhere from its prompt plus the tokens it already generated."""
        evicted = []
        for seq in [*self.running, *self.waiting]:
            if seq.is_cancel_requested:
                seq.status, seq.finish = Status.FINISHED, Finish.CANCELLED
                continue
            self.kv.forget(seq)  # its worker's pool is gone with it
            seq.num_failovers += 1
            seq.is_on_worker = False
            seq.status = Status.WAITING
            evicted.append(seq)
        self.running.clear()
        self.waiting.clear()
        self._pending_drops.clear()
        self.preempted.clear()
        self._in_flight.clear()
        self._sums.clear()
        return evicted

    @property
    def pool(self) -> BlockPool:
        """The worker's block pool, for readers (the router, metrics, the status page)."""
        return self.kv.pool

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens whose KV came from the prefix cache."""
        return (
            self.num_cached_prompt_tokens / self.num_prompt_tokens
            if self.num_prompt_tokens
            else 0.0
        )

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._pending_drops)

    # -- the two verbs -------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Plans sent and not answered yet."""
        return len(self._in_flight)

    @property
    def oldest_in_flight(self) -> StepPlan:
        """The plan the next result answers."""
        return self._in_flight[0][0]

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to send (or ``depth`` plans
        are in flight already)."""
        if len(self._in_flight) >= self.depth:
            return None
        budget = self.limits.max_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        in_plan: set[int] = set()
        by_importance = sorted(self.running, key=lambda s: (-s.priority, s.admit_order))
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in by_importance:
            (decoding if self._ahead(seq).is_decoding else prefilling).append(seq)
        grants: dict[str, int] = {}
        # Drafts wait while prompts do: a drafting step lasts several plain ones, and every
        # prompt waiting for its prefill would wait that long too.
        drafts = (
            0
            if prefilling or self.waiting or not self.speculation.num_tokens
            else self.speculation.drafts_for(
                len(decoding), [s.drafting for s in decoding if self._draft_room(s) > 0]
            )
        )
        budget = self._run(decoding, budget, chosen, in_plan, grants, drafts)
        if chosen and self.cost is not None:
            held = [*prefilling, *self.waiting]
            at = self._ahead(held[0]).num_scheduled if held else 0  # chunks in flight too
            bound = self.cost.budget(len(chosen), decoding, held, self._ticks, at)
            limit = self.cost.bound_seconds  # the step time it holds to (None: probing)
            log.debug(
                "prefill bound",
                step_id=self.num_steps + 1,
                bound=bound,
                position=at,
                bound_ms=None if limit is None else round(limit * 1e3, 2),
            )
            budget = min(budget, bound)
        budget = self._run(prefilling, budget, chosen, in_plan)
        budget = self._admit(budget, chosen)
        drops, self._pending_drops = tuple(self._pending_drops), []
        if not chosen and not drops:
            return None
        self.num_steps += 1
        return self._to_plan(self.num_steps, chosen, drops, grants)

    def update(self, result: StepResult) -> list[SeqEvent]:
        """Applies the oldest plan's result; returns what happened to each sequence."""
        if not self._in_flight or self._in_flight[0][0].step_id != result.step_id:
            raise ValueError(f"result for step {result.step_id} does not match the plan")
        plan, entries = self._in_flight.popleft()
        self._ticks += 1
        if result.adapters_changed:
            self.resident_adapters = frozenset(result.resident_adapters)
        now = self._clock()
        since = None if self._last_result_at is None else now - self._last_result_at
        self._last_result_at = now
        current, keys, decode_only = _current(entries)
        observe_step(self.cost, self.speculation, plan, result, since, keys, decode_only)
        refused = {f.seq_id: f for f in result.failed}
        retry = self.kv.settle(result, current, set(refused))
        # tokens per sequence: only a sequence verifying drafts can make more than one
        has_drafts = any(e.drafts for e in entries.values())
        made = Counter(t.seq_id for t in result.tokens) if has_drafts else Counter()
        deferred = {i for i in result.deferred_seq_ids if i in current}
        for seq_id, seq in current.items():
            entry = entries[seq_id]
            self._sums.count(entry, -1)
            if seq_id not in refused and seq_id not in deferred:
                known = seq.num_computed + entry.num_tokens
                # accepted drafts were computed too; their tokens arrive with this result
                accepted = max(made[seq_id] - 1, 0) if entry.drafts else 0
                seq.num_computed = known + accepted
                # a step where the worker had nothing to propose (an n-gram without an
                # earlier match) says nothing of how well this sequence's drafts hold
                if entry.drafts and result.num_proposed.get(seq_id, entry.drafts) > 0:
                    seq.drafting.observe(accepted)
                self.kv.commit_full_blocks(seq, known)
        events = [
            self._on_token(current[t.seq_id], t) for t in result.tokens if t.seq_id in current
        ]
        for seq in current.values():
            if seq.status is Status.RUNNING:
                self.kv.commit_full_blocks(seq)
        events += [
            self._refuse(current[i], f.error, f.is_request_error)
            for i, f in refused.items()
            if i in current and i not in retry
        ]
        for seq_id in retry:
            self._recompute(current[seq_id])
        for seq_id in deferred:  # its grammar was not ready: the next plan has it again
            seq = current[seq_id]
            if not seq.is_on_worker and seq.status is Status.RUNNING:
                self._recompute(seq)  # its last token's plan dropped it early: it starts over
            else:
                self._replan_deferred(seq, entries[seq_id])
        for seq in [s for s in self.running if s.is_cancel_requested]:
            self._finish(seq, Finish.CANCELLED)
            events.append(SeqEvent.of(seq, finish=Finish.CANCELLED))
        return events

    # -- helpers -------------------------------------------------------------------------

    def _ahead(self, seq: Sequence) -> Ahead:
        return self._sums.ahead(seq)

    def _run(
        self,
        seqs: list[Sequence],
        budget: int,
        chosen: list[tuple[Sequence, int]],
        in_plan: set[int],
        grants: dict[str, int] | None = None,
        drafts: int = 0,
    ) -> int:
        """Schedules running sequences' next tokens within ``budget`` (with up to ``drafts``
        draft tokens each, recorded in ``grants``); returns what is left."""
        for seq in seqs:
            if budget == 0:
                break
            ahead = self._ahead(seq)
            if seq.status is not Status.RUNNING or seq.is_done_after(ahead.num_samples_at_most):
                continue  # preempted while making room for another, or sampling its last
            n = min(ahead.num_unscheduled, budget)
            if n <= 0 or not self._make_room(seq, ahead.num_scheduled_at_most + n, in_plan):
                continue
            chosen.append((seq, n))
            in_plan.add(id(seq))
            budget -= n
            if grants is not None and drafts > 0:
                k = self.kv.reserve_drafts(
                    seq,
                    min(self._draft_room(seq), drafts, budget),
                    num_scheduled=ahead.num_scheduled_at_most,
                )
                if k > 0:
                    grants[seq.seq_id] = k
                    budget -= k
        return budget

    def _draft_room(self, seq: Sequence) -> int:
        """Draft tokens ``seq`` may verify: the step then makes up to that many plus one,
        which must stay within max_tokens and the context."""
        if not seq.allow_speculation or seq.sampling.constraint is not None:
            return 0
        ahead = self._ahead(seq).num_samples_at_most
        made = len(seq.output_ids) + ahead
        total = seq.num_tokens + ahead
        return min(seq.max_tokens - made - 1, seq.max_model_len - total - 1)

    def _on_token(self, seq: Sequence, token: SampledToken) -> SeqEvent:
        if seq.is_cancel_requested or seq.is_finished:
            return SeqEvent.of(seq)
        if token.token_id in seq.stop_token_ids:
            self._finish(seq, Finish.STOP)
            return SeqEvent.of(seq, finish=Finish.STOP)
        if seq.first_token_tick is None:
            seq.first_token_tick = self._ticks
        seq.output_ids.append(token.token_id)
        finish = None
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= seq.max_model_len:
            finish = Finish.LENGTH
            self._finish(seq, finish)
        top = (token.top,) if seq.sampling.top_logprobs else ()
        return SeqEvent.of(seq, (token.token_id,), (token.logprob,), finish, top)

    def _refuse(self, seq: Sequence, error: str, is_request_error: bool) -> SeqEvent:
        """The worker refused ``seq`` (and dropped it): it fails alone; the worker is fine."""
        seq.is_on_worker = False
        self._finish(seq, Finish.FAILED)
        why = f"worker refused the sequence: {error}"
        return SeqEvent.of(
            seq, finish=Finish.FAILED, error=why, is_refused=True, is_request_error=is_request_error
        )

    def _admit(self, budget: int, chosen: list[tuple[Sequence, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            admissible = admissible_waiting(self.waiting, self.running, self.max_loras)
            if not admissible:
                break
            seq = max(
                admissible, key=lambda s: (s.priority, s.num_preemptions > 0, -s.arrival_time)
            )
            self.kv.reuse_cached_prefix(seq)
            if seq.first_scheduled_time is None:
                seq.num_cached_tokens = seq.num_computed
            ahead = self._ahead(seq)
            n = min(ahead.num_unscheduled, budget)
            if not self.kv.allocate(seq, ahead.num_scheduled + n):
                self.kv.release(seq)  # its cached prefix waits in the cache, not in its table
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self._admit_counter += 1
            seq.admit_order = self._admit_counter
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += len(seq.prompt_ids)
                self.num_cached_prompt_tokens += seq.num_cached_tokens
            load = adapter_load_tokens(seq, self.resident_adapters, self.running)
            self.running.append(seq)
            chosen.append((seq, n))
            budget = max(budget - n - load, 0)
        return budget

    def _make_room(self, seq: Sequence, num_tokens: int, in_plan: set[int]) -> bool:
        """Gives ``seq`` blocks for ``num_tokens``, preempting others; False if it was preempted."""
        while not self.kv.grow(seq, num_tokens):
            # Sequences whose blocks went back early free nothing when preempted.
            candidates = [s for s in self.running if id(s) not in in_plan and s.block_ids]
            if seq not in candidates:
                candidates.append(seq)
            victim = min(candidates, key=lambda s: (s.priority, -s.admit_order))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _recompute(self, seq: Sequence) -> None:
        """A tier block ``seq`` needed failed its check (the worker refused it): it starts
        over without it, and its cached tokens are counted again at its next admission."""
        seq.is_on_worker = False
        self.num_prompt_tokens -= len(seq.prompt_ids)
        self.num_cached_prompt_tokens -= seq.num_cached_tokens
        seq.first_scheduled_time, seq.num_cached_tokens = None, 0
        self._preempt(seq)

    def _replan_deferred(self, seq: Sequence, deferred: Entry) -> None:
        """The worker kept ``seq``'s part of a step but for its last token (none with drafts)
        and sampled nothing: a later plan in flight computes its next tokens from where it
        really is, so its entry samples only if it reaches the end."""
        if seq.status is Status.RUNNING and not deferred.drafts:
            seq.num_computed += max(deferred.num_tokens - 1, 0)
            self.kv.commit_full_blocks(seq)
        at, known = seq.num_computed, seq.num_tokens
        for _, entries in self._in_flight:
            entry = entries.get(seq.seq_id)
            if entry is None or not entry.is_current:
                continue
            at += entry.num_tokens
            samples = at == known
            known += samples
            if samples != entry.samples:
                self._sums.count(entry, -1)
                entries[seq.seq_id] = entry = dataclasses.replace(entry, samples=samples)
                self._sums.count(entry, 1)

    def _drop_early(self, seq: Sequence) -> None:
        """This plan samples ``seq``'s last token: its blocks go back now, and its drop rides
        on the next plan."""
        self.kv.release_early(seq, num_scheduled=self._ahead(seq).num_scheduled)
        self._pending_drops.append(seq.seq_id)
        seq.is_on_worker = False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        self._sums.forget(seq.seq_id)  # results of plans sent before now no longer apply
        if seq.is_on_worker:
            self._pending_drops.append(seq.seq_id)
        seq.is_on_worker = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq.seq_id)
        seq.status = Status.WAITING
        self.waiting.insert(0, seq)

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.kv.release(seq)
        self._sums.forget(seq.seq_id)
        if seq.is_on_worker:
            self._pending_drops.append(seq.seq_id)
            seq.is_on_worker = False
        seq.status, seq.finish = Status.FINISHED, finish

    def _to_plan(
        self,
        step_id: int,
        chosen: list[tuple[Sequence, int]],
        drops: tuple[str, ...],
        grants: dict[str, int],
    ) -> StepPlan:
        new: list[NewSequence] = []
        scheduled: list[ScheduledSequence] = []
        entries: dict[str, Entry] = {}
        for seq, n in chosen:
            if seq.is_on_worker:
                fresh = tuple(seq.block_ids[seq.num_sent_blocks :])
            else:
                seq.incarnation += 1
                new.append(seq.as_new())
                seq.is_on_worker, fresh = True, ()
            seq.num_sent_blocks = len(seq.block_ids)
            ahead = self._ahead(seq)  # the plans in flight before this one
            # computes its last known token: samples one
            samples = ahead.num_unscheduled == n
            k = grants.get(seq.seq_id, 0)
            entries[seq.seq_id] = entry = Entry(seq, seq.incarnation, n, samples, k)
            self._sums.count(entry, 1)
            scheduled.append(ScheduledSequence(seq.seq_id, n, fresh, k))
            if self.depth > 1 and seq.is_done_after(ahead.plans.num_samples + samples):
                self._drop_early(seq)
        moves = self.kv.take_moves(step_id, [n.seq_id for n in new])
        plan = StepPlan(step_id, tuple(new), tuple(scheduled), drops, *moves)
        self._in_flight.append((plan, entries))
        return plan


def _current(entries: dict[str, Entry]) -> tuple[dict[str, Sequence], int, bool]:
    """A plan's sequences still in the incarnation it was sent to, the keys their chunks
    read, and whether each computed its newest token (none a prompt's): one pass a step."""
    current: dict[str, Sequence] = {}
    keys, decode_only = 0, True
    for seq_id, entry in entries.items():
        if entry.is_current:
            seq = current[seq_id] = entry.seq
            keys += chunk_keys(entry.num_tokens, seq.num_computed)
            decode_only = decode_only and seq.num_computed >= len(seq.prompt_ids)
    return current, keys, decode_only


def end_unplaced(seq: Sequence, finish: Finish, error: str = "") -> SeqEvent:
    """Ends a sequence that no batcher holds (its worker was lost, and it was not placed on
    another): the one place outside ``BatchScheduler`` where a status and finish are set."""
    seq.status, seq.finish = Status.FINISHED, finish
    return SeqEvent.of(seq, finish=finish, error=error)
