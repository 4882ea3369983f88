"""Constrained sequences on a worker: one llguidance matcher each, and the token masks.

A constrained sequence's logits are masked before sampling, so it can only pick a token that
continues a valid output; when its grammar is complete only end-of-sequence tokens remain,
and the scheduler stops it there. Unconstrained rows are never touched, so they sample
exactly what they would alone. A matcher's state is a function of the tokens generated so
far: a sequence resumed after a preemption or a failover replays them into a fresh matcher.

Grammar work stays off the step thread's path where it can:

    start-up       the tokenizer and the engine's view of it load on their own thread
    plan arrives   compile starts on a small thread pool (under the worker's limits), as
                   soon as the plan is read, while the steps before it still run; it builds
                   the matcher from the grammar text the gateway shipped with the
                   constraint (converted there once), or converts it here if none came;
                   a refusal fails the sequence before its first token and is kept by
                   content, so the same constraint is refused again without a build
    step top       masks of the rows this step samples start filling, all in one
                   parallel llguidance call (a row's mask needs only its earlier tokens)
    forward        runs meanwhile, on the step thread
    sampling       waits for those masks (one masked_fill over the constrained rows),
                   never for a compile: a row whose matcher is still compiling is
                   deferred (its step is undone and the scheduler plans it again); a
                   grammar not built by its deadline, or over a limit, fails its sequence
                   alone, and the other rows sample as they would have
    next step top  the sampled tokens go to every matcher in one parallel call, then
                   the masks fill, both on the mask thread
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
from transformers import AutoTokenizer

from canteen.grammar import ConstraintError, GrammarCompiler
from canteen.heap import freeze_loaded
from canteen.logging import get_logger
from canteen.plan import Constraint
from worker.engine.guard import EntryError

log = get_logger(__name__)

# the engine's words for a broken limit -> the worker flag that sets that limit
_LIMIT_FLAGS = (
    ("initial lexer configuration", "--grammar-lexer-fuel"),
    ("grammar size", "--grammar-max-size"),
    ("too many states", "--grammar-max-lexer-states"),
    ("too many items", "--grammar-step-max-items"),
)


def load_tokenizer(path: str, fmt: str) -> Any:
    weights = Path(path)
    if fmt == "gguf":
        return AutoTokenizer.from_pretrained(str(weights.parent), gguf_file=weights.name)
    return AutoTokenizer.from_pretrained(str(weights))


@dataclass(frozen=True)
class GrammarOptions:
    """How a worker compiles constraints, and the work one grammar may cost it."""

    compile_timeout: float = 5.0
    """Seconds from a sequence's arrival until its grammar must have compiled."""
    num_compile_threads: int = 2
    """Threads that compile grammars (at most this many compile at once)."""
    num_mask_threads: int = 0
    """Threads that fill a step's masks in parallel (0: llguidance's default)."""
    inline_mask_rows: int = 16
    """Steps sampling at most this many constrained rows fill their masks on the step
    thread, one row after another: with few rows, handing them to the mask thread and its
    pool (thread wake-ups, the GIL passed back and forth) costs more CPU than the fill."""
    lexer_fuel: int = 1_000_000
    """Work allowed to build a grammar's lexer (llguidance's initial_lexer_fuel)."""
    step_lexer_fuel: int = 200_000
    """Lexer work allowed for one token's mask (llguidance's step_lexer_fuel)."""
    step_max_items: int = 50_000
    """Parser items allowed for one token's mask (llguidance's step_max_items)."""
    max_lexer_states: int = 250_000
    """Lexer states one grammar may build (llguidance's max_lexer_states)."""
    max_grammar_size: int = 500_000
    """Symbols one grammar may have (llguidance's max_grammar_size)."""

    def limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
        )


@dataclass
class _Compile:
    """One sequence's matcher being built on the compile pool."""

    kind: str
    future: Future[llguidance.LLMatcher]
    arrived: float  # time.monotonic() when it was submitted


@dataclass
class StepMasks:
    """One step's masks: a bitmask row per constrained sequence that samples in it."""

    seq_ids: list[str]
    bits: np.ndarray | None  # int32 [len(seq_ids), words] (llguidance's layout), once needed
    filled: set[int]  # rows the early fill covers
    early: Future[torch.Tensor] | None  # that fill, running while the forward does: the
    # rows' blocked tokens (bool [len(seq_ids), vocab]), unpacked on the mask thread too

    def wait(self) -> torch.Tensor | None:
        return None if self.early is None else self.early.result()


class Constraints:
    """The matchers of this worker's constrained sequences, by sequence id."""

    def __init__(
        self,
        load: Callable[[], Any],
        vocab_size: int,
        eos_ids: Sequence[int],
        options: GrammarOptions | None = None,
    ) -> None:
        self._load = load
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.options = options or GrammarOptions()
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._loaded = threading.Event()  # set once the first load of the tokenizer ended
        self._loaded_at = 0.0
        self._compiles: dict[str, _Compile] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # tokens sampled last step, not yet fed to their matchers (the next fill does it)
        self._unconsumed: list[tuple[llguidance.LLMatcher, int]] = []
        # its threads start with the first constrained sequence
        self._pool = ThreadPoolExecutor(
            self.options.num_compile_threads, thread_name_prefix="grammar-compile"
        )
        self._mask_thread: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:  # the tokenizer loads once, on the first compile
            try:
                if self._compiler is None:
                    self._compiler = GrammarCompiler(
                        self._load(), self.vocab_size, self.eos_ids, self.options.limits()
                    )
                    self._loaded_at = time.monotonic()
                return self._compiler
            finally:
                self._loaded.set()

    def preload(self) -> None:
        """Loads the tokenizer and the engine's view of it on a thread of its own, now rather
        than on the first constrained sequence: a GGUF tokenizer takes seconds to build."""
        threading.Thread(target=self._preload, name="grammar-tokenizer", daemon=True).start()

    def wait_loaded(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the preload to end (loaded or failed); False
        if it has not. The load holds the GIL for up to ~200 ms at a time over ~4 s
        (SmolLM2's GGUF, AMD EPYC Zen 4): a worker that serves meanwhile stalls its steps,
        so readiness waits for it (the warm-up runs beside it)."""
        return self._loaded.wait(timeout)

    def _preload(self) -> None:
        try:
            self.compiler  # noqa: B018 -- the property loads it
            freeze_loaded("grammar tokenizer")
        except Exception as exc:  # the first compile tries again and fails its sequence
            log.warning("grammar tokenizer did not load", error=str(exc))

    def prefetch(self, constraints: Sequence[Constraint]) -> None:
        """Starts compiling the constraints of a plan that has arrived but not run yet (the
        steps before it still running): their sequences then find the grammar built, or
        being built, and share that one compile. Thread-safe; never waits."""
        for constraint in constraints:
            self._pool.submit(self._warm, constraint)

    def _warm(self, constraint: Constraint) -> None:
        try:
            self.compiler.matcher(constraint)
        except Exception:  # the sequence's own build reports it, to it alone
            pass

    def add(self, seq_id: str, constraint: Constraint, generated: Sequence[int]) -> None:
        """Starts building ``seq_id``'s matcher off this thread; it replays the tokens the
        sequence generated before a resume."""
        future: Future[llguidance.LLMatcher] | None = None
        compiler = self._compiler
        start = None if compiler is None or generated else compiler.cached_matcher(constraint)
        if start is not None:  # compiled before: a copy of its start, no compile to wait for
            future = Future()
            future.set_result(start)
        else:
            future = self._pool.submit(self._build, seq_id, constraint, tuple(generated))
        self._compiles[seq_id] = _Compile(constraint.kind, future, time.monotonic())

    def drop(self, seq_id: str) -> None:
        pending = self._compiles.pop(seq_id, None)
        if pending is not None:
            pending.future.cancel()  # one already compiling finishes unseen
        self._matchers.pop(seq_id, None)

    def clear(self) -> None:
        for seq_id in list(self._compiles):
            self.drop(seq_id)
        self._matchers.clear()
        self._unconsumed.clear()

    def failure(self, seq_id: str) -> str | None:
        """Why ``seq_id``'s grammar failed, if its compile has ended and failed; never waits."""
        pending = self._compiles.get(seq_id)
        if pending is None or not pending.future.done():
            return None
        return self.settle(seq_id)

    def is_pending(self, seq_id: str) -> bool:
        """Whether ``seq_id``'s matcher is still being built (``settle`` has not taken it)."""
        return seq_id in self._compiles

    def settle(self, seq_id: str, wait: float = 0.0) -> str | None:
        """Takes ``seq_id``'s matcher once its compile has ended, waiting at most ``wait``
        seconds for it; returns the error that fails the sequence, or None: ready,
        unconstrained, or still compiling (``is_pending``). A compile not done by its deadline
        fails. The deadline counts from the sequence's arrival, or from the end of the
        worker's one load of the tokenizer if that came later: the load is the worker's cost,
        not the grammar's."""
        pending = self._compiles.get(seq_id)
        if pending is None:
            return None
        if not pending.future.done():
            deadline = self._deadline(pending)
            bound = wait if deadline is None else min(wait, deadline - time.monotonic())
            if bound > 0:
                concurrent.futures.wait([pending.future], timeout=bound)
            if not pending.future.done():
                if deadline is None or time.monotonic() < deadline:
                    return None  # not ready yet, and not late
                del self._compiles[seq_id]
                pending.future.cancel()
                timeout = self.options.compile_timeout
                return (
                    f"sequence {seq_id}: {pending.kind}: its grammar did not compile within "
                    f"grammar_compile_timeout={timeout:g}s (the worker's "
                    "--grammar-compile-timeout)"
                )
        del self._compiles[seq_id]
        try:
            self._matchers[seq_id] = pending.future.result()
        except EntryError as exc:
            return str(exc)
        except Exception as exc:  # the engine or the tokenizer broke: this sequence only
            return f"sequence {seq_id}: {pending.kind}: its grammar did not compile: {exc}"
        return None

    def _deadline(self, pending: _Compile) -> float | None:
        """When ``pending`` must have compiled (time.monotonic()); None while the tokenizer
        still loads."""
        if not self._loaded.is_set():
            return None
        return max(pending.arrived, self._loaded_at) + self.options.compile_timeout

    def begin(self, seq_ids: Sequence[str]) -> StepMasks | None:
        """Starts filling the masks of the constrained ones among ``seq_ids`` (the sequences
        this step samples) whose matchers are ready, in one parallel call off this thread;
        the forward runs meanwhile. Never waits for a compile."""
        unconsumed, self._unconsumed = self._unconsumed, []
        rows = [s for s in seq_ids if s in self._matchers or s in self._compiles]
        if not rows:
            self._consume(unconsumed)
            return None
        for seq_id in rows:
            pending = self._compiles.get(seq_id)
            if pending is not None and pending.future.done() and not pending.future.exception():
                self.settle(seq_id)  # compiled already: its mask can start now
        ready = [(self._matchers[s], i) for i, s in enumerate(rows) if s in self._matchers]
        if len(ready) <= self.options.inline_mask_rows:  # ``mask`` fills them, on this thread
            self._consume(unconsumed)
            return StepMasks(rows, None, set(), None)
        masks = StepMasks(rows, None, {i for _, i in ready}, None)
        if ready:  # a matcher exists, so the compiler (and its tokenizer) does too
            masks.bits = self._new_bits(len(rows))
            masks.early = self._masker().submit(self._prepare, unconsumed, ready, masks.bits)
        else:
            self._consume(unconsumed)
        return masks

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[str], masks: StepMasks) -> None:
        """Sets to -inf, in place, every logit a row's grammar does not allow next, in one
        ``masked_fill`` over the rows; rows of ``seq_ids`` without a matcher are left alone."""
        blocked = masks.wait()
        at = {s: i for i, s in enumerate(masks.seq_ids)}
        rows = [(row, at[s]) for row, s in enumerate(seq_ids) if s in at and s in self._matchers]
        if not rows:
            return
        late = [(self._matchers[masks.seq_ids[i]], i) for _, i in rows if i not in masks.filled]
        if late or blocked is None or blocked.shape[1] != logits.shape[-1]:
            if masks.bits is None:
                masks.bits = self._new_bits(len(masks.seq_ids))
            if late:  # compiled during the forward
                self._fill(late, masks.bits)
            matchers = [self._matchers.get(s) for s in masks.seq_ids]
            blocked = self._blocked(masks.bits, matchers, logits.shape[-1])
        picked = [i for _, i in rows]
        if picked != list(range(blocked.shape[0])):
            blocked = blocked[picked]
        blocked = blocked.to(logits.device)
        if len(rows) == logits.shape[0]:  # every row constrained: no gather, no scatter
            logits.masked_fill_(blocked, float("-inf"))
            return
        index = torch.tensor([row for row, _ in rows], device=logits.device)
        logits[index] = logits[index].masked_fill_(blocked, float("-inf"))

    def _blocked(
        self, bits: np.ndarray, matchers: list[llguidance.LLMatcher | None], vocab: int
    ) -> torch.Tensor:
        """The tokens each row may not take next (bool [rows, vocab]); a row whose grammar
        allows nothing (or broke) may only end its sequence rather than emit free text."""
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = allowed.astype(bool)
        if allowed.shape[1] < vocab:
            allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
        stuck = np.logical_not(allowed.any(axis=1))
        for k, matcher in enumerate(matchers):
            if matcher is not None and (stuck[k] or matcher.is_error()):
                allowed[k] = False
                allowed[k, [e for e in self.eos_ids if e < vocab]] = True
        return torch.from_numpy(~allowed)

    def finish(self, masks: StepMasks | None) -> None:
        """Waits for the step's early fill, if any, however the step ended."""
        if masks is not None and masks.early is not None:
            concurrent.futures.wait([masks.early])

    def advance(self, tokens: Sequence[tuple[str, int]]) -> None:
        """Queues each constrained sequence's sampled tokens, in order, for its matcher: the
        next step's early fill consumes them all in one parallel call before it computes
        the masks, off this thread (a token the grammar refuses leaves that matcher in
        error, and its next mask allows only the end)."""
        found = ((self._matchers.get(s), t) for s, t in tokens)
        self._unconsumed += [(m, t) for m, t in found if m is not None]

    def _consume(self, pairs: list[tuple[llguidance.LLMatcher, int]]) -> None:
        few = len(pairs) <= self.options.inline_mask_rows
        if few or len({id(m) for m, _ in pairs}) < len(pairs):  # or several tokens of one
            for matcher, token in pairs:
                matcher.consume_token(token)
        elif pairs:
            self._parallel().consume_token_par(pairs)

    def _prepare(
        self,
        pairs: list[tuple[llguidance.LLMatcher, int]],
        rows: list[tuple[llguidance.LLMatcher, int]],
        bits: np.ndarray,
    ) -> torch.Tensor:
        """On the mask thread: last step's tokens consumed, then the masks filled and
        unpacked into the tokens each row may not take."""
        self._consume(pairs)
        self._fill(rows, bits)
        by_row: list[llguidance.LLMatcher | None] = [None] * len(bits)
        for matcher, i in rows:
            by_row[i] = matcher
        return self._blocked(bits, by_row, self.vocab_size)

    def _build(
        self, seq_id: str, constraint: Constraint, generated: Sequence[int]
    ) -> llguidance.LLMatcher:
        """On a compile thread: the sequence's matcher, after the tokens it generated."""
        try:
            matcher = self.compiler.matcher(constraint)
        except ConstraintError as exc:
            raise EntryError(seq_id, _name_limit(str(exc))) from None
        for token in generated:
            if not matcher.consume_token(token):
                raise EntryError(seq_id, f"token {token} does not fit its {constraint.kind}")
        return matcher

    def _new_bits(self, num_rows: int) -> np.ndarray:
        words = (self.compiler.tokenizer.vocab_size + 31) // 32
        return np.zeros((num_rows, words), dtype=np.int32)

    def _masker(self) -> ThreadPoolExecutor:
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._mask_thread

    def _parallel(self) -> llguidance.LLExecutor:
        if self._executor is None:
            threads = self.options.num_mask_threads or None
            self._executor = llguidance.LLExecutor(threads)
        return self._executor

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], bits: np.ndarray) -> None:
        if len(rows) > self.options.inline_mask_rows:
            fill_next_token_bitmask_par(self._parallel(), rows, bits)
            return
        for matcher, row in rows:  # few: no pool to wake
            fill_next_token_bitmask(matcher, bits, row)


def _name_limit(message: str) -> str:
    """``message``, followed by the worker flag of the limit it reports breaking."""
    lowered = message.lower()
    for words, flag in _LIMIT_FLAGS:
        if words in lowered:
            return f"{message} (the worker's {flag})"
    return message
