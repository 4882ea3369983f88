"""Applies step plans to per-sequence state and runs one forward pass per step.

The runner owns the paged KV pool and every sequence's tokens and block table; it writes KV
only into the blocks the scheduler named. It is not thread-safe: one thread runs it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from canteen.adapters import AdapterRef
from canteen.plan import (
    FailedSequence,
    NewSequence,
    SampledToken,
    Sampling,
    ScheduledSequence,
    StepPlan,
    StepResult,
)
from worker.attention.batch import BatchBuilder, Row, new_kv_pool
from worker.attention.interface import PagedBatch
from worker.engine.constrain import Constraints, GrammarOptions, StepMasks, load_tokenizer
from worker.engine.drafts import draft_limit, propose
from worker.engine.graphs import DEFAULT_GRAPHS, DecodeGraphs, DecodeRow, GraphSizes
from worker.engine.guard import BlockLedger, EntryError, root_key
from worker.engine.sampler import sample
from worker.engine.threads import SMALL_STEP_MMACS, StepThreads, row_macs
from worker.kv_tiers.store import KVTiers, move
from worker.lora.adapter import LoraError
from worker.lora.manager import LoraManager
from worker.lora.store import LoraOptions
from worker.model.forward import FastModel
from worker.model.loader import LoadedModel
from worker.speculation.draft import DraftModel, can_share_kv
from worker.speculation.speculate import SpeculationConfig, accept

# How long a step that holds only sequences whose grammars still compile waits for one of
# them (seconds): nobody else waits behind it, and the scheduler need not plan it again.
IDLE_COMPILE_WAIT = 0.01


@dataclass
class SequenceState:
    """A ``NewSequence`` as the worker keeps it while it runs: its tokens and blocks grow."""

    seq_id: str
    tokens: list[int]
    sampling: Sampling
    block_ids: list[int]
    num_computed: int
    keys: list[bytes]  # chained content keys of its full computed blocks (worker/engine/guard.py)
    drafts: list[int] = field(default_factory=list)  # this step's draft tokens, if any
    adapter: AdapterRef | None = None  # its LoRA adapter; None: the base model
    root: bytes = root_key(None)  # where its block keys' chain starts (worker/engine/guard.py)


@dataclass(frozen=True)
class RunnerConfig:
    """The shape of one runner: its KV pool, its step budget and how it decodes."""

    num_blocks: int
    block_size: int
    max_batched_tokens: int
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    draft_shares_kv: bool = False
    """The draft model reads and writes the target's KV pool (only with its KV layout)."""
    graphs: GraphSizes | None = DEFAULT_GRAPHS
    """Which decode steps replay CUDA graphs (worker/engine/graphs.py); used on CUDA with Canteen's
    forward, or anywhere with ``eager=True``; None: none."""
    grammar: GrammarOptions = field(default_factory=GrammarOptions)
    """How constraints compile (threads, deadline, limits) and their masks fill."""
    lora: LoraOptions = field(default_factory=LoraOptions)
    """How many LoRA adapters a step applies and memory holds (worker/lora/)."""
    narrow_step_rows: int = 0
    """Steps of at most this many token rows compute on one torch thread (worker/engine/
    threads.py); 0: every step on ``num_threads``."""
    num_threads: int = 0
    """torch threads for wider steps; 0: torch's count when the runner is built."""
    small_step_mmacs: int = SMALL_STEP_MMACS
    """Steps whose linears make fewer million multiply-adds compute on one torch thread
    (worker/engine/threads.py); 0: none."""


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, config: RunnerConfig, draft: LoadedModel | None = None
    ) -> None:
        """``draft``: the model that proposes tokens with ``--speculative draft``."""
        self.loaded = loaded
        self.config = config
        self.speculation = config.speculation
        num_blocks, block_size = config.num_blocks, config.block_size
        max_batched_tokens, graphs = config.max_batched_tokens, config.graphs
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batched_tokens = max_batched_tokens
        graphed = graphs is not None and (
            graphs.eager or (loaded.device.type == "cuda" and loaded.forward_name == "fast")
        )
        # a graphed step's padding rows write into one scratch block past the scheduler's
        self.kv_pool = new_kv_pool(loaded, num_blocks + int(graphed), block_size)
        self.sequences: dict[str, SequenceState] = {}
        self.threads = StepThreads(
            config.narrow_step_rows,
            config.num_threads,
            row_macs(loaded.model.config),
            config.small_step_mmacs * 1_000_000,
        )
        self.vocab_size = int(loaded.model.config.vocab_size)
        self.max_model_len = loaded.max_model_len
        self.ledger = BlockLedger(num_blocks, block_size, self.vocab_size)
        self.tiers = KVTiers()  # none until the worker opens its own (worker/kv_tiers/)
        self.constraints = Constraints(
            lambda: load_tokenizer(loaded.path, loaded.fmt),
            self.vocab_size,
            loaded.eos_token_ids,
            config.grammar,
        )
        self.constraints.preload()
        # A decode group gathers at most what the warm-up's decode did (one sequence after a
        # max_batched_tokens prefill), so the warm-up's peak bounds every later step's memory.
        self.max_group_blocks = min(num_blocks, self.blocks_for(max_batched_tokens + 1))
        self.builder = BatchBuilder(
            self.kv_pool, block_size, max_batched_tokens, self.max_group_blocks, loaded.dtype
        )
        if (draft is not None) != (self.speculation.kind == "draft"):
            raise ValueError("a draft model goes with --speculative draft, and only with it")
        if config.draft_shares_kv and (draft is None or not can_share_kv(loaded, draft, True)):
            raise ValueError("only a draft with the target's KV layout can share its pool")
        self.draft = (
            DraftModel(
                draft,
                num_blocks,
                block_size,
                max_batched_tokens,
                self.max_group_blocks,
                shared_pool=self.kv_pool if config.draft_shares_kv else None,
            )
            if draft is not None
            else None
        )
        fast = isinstance(loaded.forward, FastModel)
        self.lora = LoraManager(
            config.lora,
            loaded.model.config,
            loaded.dtype,
            loaded.device,
            "" if fast else "adapters need Canteen's forward (--forward fast, llama family)",
        )
        self.graphs = (
            DecodeGraphs(loaded.forward, self.kv_pool, num_blocks, self.max_model_len, graphs)
            if graphed and graphs is not None
            else None
        )

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def prefetch_grammars(self, plan: StepPlan) -> None:
        """Starts compiling the grammars of ``plan``'s new sequences now, from the thread that
        reads plans, while earlier steps run (thread-safe; never waits)."""
        news = plan.new_sequences
        self.constraints.prefetch([c for n in news if (c := n.sampling.constraint) is not None])

    def step(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter_ns()
        self.threads.apply(plan.num_tokens)
        moved = None
        for seq_id in plan.dropped_seq_ids:  # first: a reload may reuse a dropped one's block
            self._drop(seq_id)
        if plan.offload_block_ids or plan.reload_block_ids or self.tiers.is_on:
            # tier moves first: offloads before the forward overwrites their blocks, reloads
            # before the new sequences that count them as cached are checked
            moved = move(
                self.tiers,
                self.kv_pool,
                self.ledger,
                plan.offloads,
                plan.reloads,
                self.loaded.forward_name == "fast",  # its head-major pool layout
            )
        result = self._compute(plan, started)
        return result if moved is None else moved.onto(result)

    def _compute(self, plan: StepPlan, started: int) -> StepResult:
        plan, failed = self._apply(plan)
        if not plan.scheduled:
            return self.lora.annotate(
                StepResult(
                    step_id=plan.step_id,
                    failed=tuple(failed),
                    total_ns=time.perf_counter_ns() - started,
                )
            )
        # the masks of the rows this step samples fill while the forward runs
        masks = self.constraints.begin([i.seq_id for i in plan.scheduled if self._samples(i)])
        deferred: list[str] = []
        try:
            with torch.inference_mode():  # the sampler's ops too: no autograd bookkeeping
                forward_start = time.perf_counter_ns()
                logits, sample_rows = self._forward(plan)
                sample_start = time.perf_counter_ns()
                proposed = {
                    s.seq_id: len(self.sequences[s.seq_id].drafts)
                    for s in plan.scheduled
                    if s.num_draft_tokens
                }
                num_drafts = sum(proposed.values())
                tokens = self._sample_and_advance(
                    plan, logits, sample_rows, masks, failed, deferred
                )
        finally:
            self.constraints.finish(masks)  # no fill outlives its step
        done = time.perf_counter_ns()
        result = StepResult(
            step_id=plan.step_id,
            tokens=tuple(tokens),
            failed=tuple(failed),
            deferred_seq_ids=tuple(deferred),
            num_tokens=plan.num_tokens + num_drafts,
            num_draft_tokens=num_drafts,
            num_accepted_tokens=len(tokens) - len({t.seq_id for t in tokens}),
            num_proposed=proposed,
            forward_ns=sample_start - forward_start,
            sample_ns=done - sample_start,
            total_ns=done - started,
        )
        return self.lora.annotate(result)

    def reset(self) -> None:
        """Forgets every sequence (a new Run stream owns the worker from here on)."""
        self.sequences.clear()
        self.ledger.release_all()
        self.constraints.clear()
        if self.draft is not None:
            self.draft.reset()

    def _apply(self, plan: StepPlan) -> tuple[StepPlan, list[FailedSequence]]:
        """Applies drops and new sequences; returns the entries that can run this step and
        the sequences refused (each dropped here, failing alone)."""
        failed: dict[str, FailedSequence] = {}
        for seq_id in plan.dropped_seq_ids:
            self._drop(seq_id)
        for new in plan.new_sequences:
            try:
                self._add(new)
            except EntryError as exc:
                failed[new.seq_id] = FailedSequence(new.seq_id, str(exc))
            except LoraError as exc:  # the request named an adapter this worker cannot serve
                adapter = new.adapter.id if new.adapter else ""
                reason = f"sequence {new.seq_id}: adapter {adapter}: {exc}"
                failed[new.seq_id] = FailedSequence(new.seq_id, reason, is_request_error=True)
        runnable: list[ScheduledSequence] = []
        for item in plan.scheduled:
            if item.seq_id in failed:
                continue
            try:
                self._schedule(item)
                error = self.constraints.failure(item.seq_id)  # failed already: no forward
                failure = None if error is None else FailedSequence(item.seq_id, error, True)
            except EntryError as exc:
                failure = FailedSequence(item.seq_id, str(exc))
            if failure is None:
                runnable.append(item)
            else:
                failed[item.seq_id] = failure
                self._drop(item.seq_id)
        if any(self.sequences[i.seq_id].adapter for i in runnable):
            entries = [(i.seq_id, self.sequences[i.seq_id].adapter) for i in runnable]
            for failure in self.lora.place(entries):
                failed[failure.seq_id] = failure
                self._drop(failure.seq_id)
            runnable = [i for i in runnable if i.seq_id not in failed]
        ok = dataclasses.replace(plan, new_sequences=(), scheduled=tuple(runnable))
        return ok, list(failed.values())

    def _drop(self, seq_id: str) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            self.ledger.release(seq.block_ids)
            self.constraints.drop(seq_id)
            if self.draft is not None:
                self.draft.drop(seq_id)

    def _add(self, new: NewSequence) -> None:
        if new.seq_id in self.sequences:
            self._drop(new.seq_id)  # ids are unique: whatever this is, it runs no further
            raise EntryError(new.seq_id, "sent twice")
        if len(new.token_ids) > self.max_model_len:
            raise EntryError(
                new.seq_id,
                f"{len(new.token_ids)} tokens exceed the context of {self.max_model_len}",
            )
        keys = self.ledger.check_new(new)
        if new.adapter is not None:
            self.lora.check(new.adapter)  # loaded (digest checked) before anything is held
        if new.sampling.constraint is not None:
            # tokens past the prompt were generated before a resume: the grammar saw them
            generated = new.token_ids[new.num_prompt_tokens :] if new.num_prompt_tokens else ()
            self.constraints.add(new.seq_id, new.sampling.constraint, generated)
        self.ledger.hold(new.block_ids)
        self.sequences[new.seq_id] = SequenceState(
            seq_id=new.seq_id,
            tokens=list(new.token_ids),
            sampling=new.sampling,
            block_ids=list(new.block_ids),
            num_computed=new.num_cached_tokens,
            keys=keys,
            adapter=new.adapter,
            root=root_key(new.adapter),
        )

    def _schedule(self, item: ScheduledSequence) -> None:
        seq = self.sequences.get(item.seq_id)
        if seq is None:
            raise EntryError(item.seq_id, "is not known to this worker")
        self.ledger.check_more(seq.seq_id, seq.block_ids, item.new_block_ids)
        self.ledger.hold(item.new_block_ids)
        seq.block_ids.extend(item.new_block_ids)
        end = seq.num_computed + item.num_tokens
        if item.num_tokens <= 0 or end > len(seq.tokens):
            raise EntryError(
                seq.seq_id,
                f"cannot compute {item.num_tokens} tokens after "
                f"{seq.num_computed} of {len(seq.tokens)}",
            )
        if end > len(seq.block_ids) * self.block_size:
            raise EntryError(
                seq.seq_id,
                f"{end} tokens need more than its {len(seq.block_ids)} blocks of {self.block_size}",
            )
        self.ledger.will_write(seq.block_ids, seq.num_computed, end)

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """The step's logits and the flat rows they came from: a captured graph's where the
        step is plain decode that fits one, else the eager forward."""
        graphed = self._graph_rows(plan)
        with torch.inference_mode():
            if graphed is not None and self.graphs is not None:
                return self.graphs.run(graphed), list(range(len(graphed)))
            batch, input_ids, positions, sample_rows = self._build(plan)
            num_rows = input_ids.shape[0]  # kept rows ascend: as many as rows is every row
            keep = (
                None
                if len(sample_rows) == num_rows
                else torch.tensor(sample_rows or [num_rows - 1], device=self.loaded.device)
            )
            seqs = [(self.sequences[i.seq_id], i.num_tokens) for i in plan.scheduled]
            rows = [(s.adapter, n + len(s.drafts)) for s, n in seqs]  # drafts set by _build
            lora = self.lora.step(rows, self.loaded.device)
            if lora is not None:  # only a FastModel runs adapters (LoraManager's refusal)
                fast: FastModel = self.loaded.forward  # type: ignore[assignment]
                return fast(input_ids, positions, batch, keep, lora), sample_rows
            return self.loaded.forward(input_ids, positions, batch, keep), sample_rows

    def _graph_rows(self, plan: StepPlan) -> list[DecodeRow] | None:
        """The step as graph rows: every sequence decodes its one last token, drafts none."""
        if self.graphs is None or not self.graphs.fits(len(plan.scheduled), 0):
            return None
        rows, bs = [], self.block_size
        for item in plan.scheduled:
            seq = self.sequences[item.seq_id]
            position = seq.num_computed
            if item.num_tokens != 1 or position + 1 != len(seq.tokens) or self._draft_limit(item):
                return None
            if seq.adapter is not None:  # graphs hold the base linears only
                return None
            slot = seq.block_ids[position // bs] * bs + position % bs
            blocks = seq.block_ids[: position // bs + 1]
            rows.append(DecodeRow(seq.tokens[position], position, slot, blocks))
        longest = max(r.position + 1 for r in rows)
        return rows if self.graphs.fits(len(rows), longest) else None

    def _build(self, plan: StepPlan) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, list[int]]:
        rows = []
        proposals = self._propose(plan)
        for item in plan.scheduled:
            seq = self.sequences[item.seq_id]
            start, end = seq.num_computed, seq.num_computed + item.num_tokens
            seq.drafts = proposals.get(seq.seq_id, [])
            if seq.drafts:
                self.ledger.will_write(seq.block_ids, end, end + len(seq.drafts))
            samples = end == len(seq.tokens)  # its last token, and then each draft
            tokens = seq.tokens[start:end] + seq.drafts
            rows.append(Row(tokens, start, seq.block_ids, 1 + len(seq.drafts) if samples else 0))
        return self.builder.build(rows)

    def _propose(self, plan: StepPlan) -> dict[str, list[int]]:
        """Draft tokens per sequence, by prompt lookup or from the draft model."""
        if not self.speculation.is_on:
            return {}
        wanted = [(self.sequences[i.seq_id], self._draft_limit(i)) for i in plan.scheduled]
        return propose(wanted, self.speculation, self.draft)

    def _draft_limit(self, item: ScheduledSequence) -> int:
        seq, spec = self.sequences[item.seq_id], self.speculation
        return draft_limit(seq, item, spec, self.block_size, self.max_model_len)

    def _samples(self, item: ScheduledSequence) -> bool:
        """Whether ``item`` computes its sequence's last token this step (and so samples)."""
        seq = self.sequences[item.seq_id]
        return seq.num_computed + item.num_tokens == len(seq.tokens)

    def _sample_and_advance(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        sample_rows: list[int],
        masks: StepMasks | None,
        failed: list[FailedSequence],
        deferred: list[str],
    ) -> list[SampledToken]:
        """Samples and appends the step's tokens. A constrained sequence whose grammar is
        still compiling goes to ``deferred``: it samples nothing and keeps all but the last
        token it computed (a prompt is not computed again; the scheduler plans that last
        token again, which samples once the grammar is ready); one whose
        grammar failed goes to ``failed``; the other rows sample as they would alone."""
        # one row per sampled position: a sequence's last token, then each of its drafts
        sampling_seqs = [self.sequences[i.seq_id] for i in plan.scheduled if self._samples(i)]
        per_row = [(s, i) for s in sampling_seqs for i in range(1 + len(s.drafts))]
        # the sampler ranks bfloat16 logits in float32
        rows = logits if logits.shape[0] == len(per_row) else logits[: len(per_row)]
        held: set[str] = set()
        if masks is not None:
            held = self._settle(sampling_seqs, len(plan.scheduled), failed, deferred)
        for item in plan.scheduled:
            num_kept = item.num_tokens
            if item.seq_id in held:  # a deferred row keeps its KV but for its last token
                is_kept = item.seq_id in deferred and not item.num_draft_tokens
                num_kept = max(item.num_tokens - 1, 0) if is_kept else 0
                if not num_kept:
                    continue
            seq = self.sequences[item.seq_id]
            seq.num_computed += num_kept
            self.ledger.computed(seq.block_ids, seq.tokens, seq.keys, seq.num_computed, seq.root)
        if held:
            keep = [r for r, (s, _) in enumerate(per_row) if s.seq_id not in held]
            with torch.inference_mode():
                rows = rows[torch.tensor(keep, dtype=torch.long, device=rows.device)]
            per_row = [per_row[r] for r in keep]
            sampling_seqs = [s for s in sampling_seqs if s.seq_id not in held]
        if not sampling_seqs:
            return []
        seq_ids = [s.seq_id for s, _ in per_row]
        if masks is not None:
            rows = rows.float()  # masked in place: a copy in bfloat16, the same tensor in float32
            with torch.inference_mode():  # the logits are inference tensors
                self.constraints.mask(rows, seq_ids, masks)
        token_ids, logprobs, tops = sample(
            rows, [s.sampling for s, _ in per_row], [len(s.tokens) + i for s, i in per_row]
        )
        out = []
        row = 0
        for seq in sampling_seqs:
            n = 1 + len(seq.drafts)
            kept = accept(seq.drafts, token_ids[row : row + n])
            if self.draft is not None and seq.drafts:
                self.draft.verified(seq.seq_id, len(seq.tokens), len(kept))
            for i, token in enumerate(kept):
                seq.tokens.append(token)
                out.append(SampledToken(seq.seq_id, token, logprobs[row + i], tops[row + i]))
            if len(kept) > 1:  # the accepted drafts' KV was computed with the right tokens
                seq.num_computed += len(kept) - 1
                self.ledger.computed(
                    seq.block_ids, seq.tokens, seq.keys, seq.num_computed, seq.root
                )
            seq.drafts = []
            row += n
        if masks is not None:
            self.constraints.advance([(t.seq_id, t.token_id) for t in out])
        return out

    def _settle(
        self,
        seqs: list[SequenceState],
        num_scheduled: int,
        failed: list[FailedSequence],
        deferred: list[str],
    ) -> set[str]:
        """Takes the matchers of the constrained ``seqs`` that compiled, without waiting
        for one still compiling, unless the step holds nothing else (then briefly: nobody
        waits behind it); returns the ids that do not sample this step: failed (dropped) or
        deferred."""
        pending = [s.seq_id for s in seqs if self.constraints.is_pending(s.seq_id)]
        until = time.monotonic() + (IDLE_COMPILE_WAIT if len(pending) == num_scheduled else 0.0)
        held: set[str] = set()
        for seq in seqs:
            error = self.constraints.settle(seq.seq_id, until - time.monotonic())
            if error is not None:
                failed.append(FailedSequence(seq.seq_id, error, is_request_error=True))
                self._drop(seq.seq_id)
                held.add(seq.seq_id)
            elif self.constraints.is_pending(seq.seq_id):
                deferred.append(seq.seq_id)
                held.add(seq.seq_id)
        return held
