"""Constrained sequences on a worker: one llguidance matcher each, and the token masks.

A constrained sequence's logits are masked before sampling, so it can only pick a token that
continues a valid output; when its grammar is complete only end-of-sequence tokens remain,
and the scheduler stops it there. Unconstrained rows are never touched, so they sample
exactly what they would alone. A matcher's state is a function of the tokens generated so
far: a sequence resumed after a preemption or a failover replays them into a fresh matcher.

Grammar work stays off the step thread's path where it can:

    start-up       the tokenizer and the engine's view of it load on their own thread
    plan arrives   compile starts on a small thread pool (under the worker's limits)
    step top       masks of the rows this step samples start filling, all in one
                   parallel llguidance call (a row's mask needs only its earlier tokens)
    forward        runs meanwhile, on the step thread
    sampling       waits for those masks, and for a matcher still compiling at most until
                   its deadline; a grammar that misses it, or breaks a limit, fails its
                   sequence alone and the other rows sample as they would have
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
from llguidance.numpy import fill_next_token_bitmask_par
from transformers import AutoTokenizer

from canteen.grammar import ConstraintError, GrammarCompiler
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
    early: Future[None] | None  # that fill, running while the forward does

    def wait(self) -> None:
        if self.early is not None:
            self.early.result()


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
        # made on the first constrained sequence: a worker that never sees one has no threads
        self._pool: ThreadPoolExecutor | None = None
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

    def _preload(self) -> None:
        try:
            self.compiler  # noqa: B018 -- the property loads it
        except Exception as exc:  # the first compile tries again and fails its sequence
            log.warning("grammar tokenizer did not load", error=str(exc))

    def add(self, seq_id: str, constraint: Constraint, generated: Sequence[int]) -> None:
        """Starts building ``seq_id``'s matcher off this thread; it replays the tokens the
        sequence generated before a resume."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.options.num_compile_threads, thread_name_prefix="grammar-compile"
            )
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

    def failure(self, seq_id: str) -> str | None:
        """Why ``seq_id``'s grammar failed, if its compile has ended and failed; never waits."""
        pending = self._compiles.get(seq_id)
        if pending is None or not pending.future.done():
            return None
        return self.settle(seq_id)

    def settle(self, seq_id: str) -> str | None:
        """Waits for ``seq_id``'s matcher, at most until its deadline; returns the error
        that fails the sequence, or None when it is ready (or unconstrained). The deadline
        counts from its arrival, or from the end of the worker's one load of the tokenizer
        if that came later: the load is the worker's cost, not the grammar's."""
        pending = self._compiles.pop(seq_id, None)
        if pending is None:
            return None
        self._loaded.wait()
        start = max(pending.arrived, self._loaded_at)
        left = max(start + self.options.compile_timeout - time.monotonic(), 0.0)
        try:
            self._matchers[seq_id] = pending.future.result(timeout=left)
        except concurrent.futures.TimeoutError:
            pending.future.cancel()
            timeout = self.options.compile_timeout
            return (
                f"sequence {seq_id}: {pending.kind}: its grammar did not compile within "
                f"grammar_compile_timeout={timeout:g}s (the worker's --grammar-compile-timeout)"
            )
        except EntryError as exc:
            return str(exc)
        except Exception as exc:  # the engine or the tokenizer broke: this sequence only
            return f"sequence {seq_id}: {pending.kind}: its grammar did not compile: {exc}"
        return None

    def begin(self, seq_ids: Sequence[str]) -> StepMasks | None:
        """Starts filling the masks of the constrained ones among ``seq_ids`` (the sequences
        this step samples) whose matchers are ready; the forward runs meanwhile."""
        rows = [s for s in seq_ids if s in self._matchers or s in self._compiles]
        if not rows:
            return None
        for seq_id in rows:
            pending = self._compiles.get(seq_id)
            if pending is not None and pending.future.done() and not pending.future.exception():
                self.settle(seq_id)  # compiled already: its mask can start now
        ready = [(self._matchers[s], i) for i, s in enumerate(rows) if s in self._matchers]
        masks = StepMasks(rows, None, {i for _, i in ready}, None)
        if ready:  # a matcher exists, so the compiler (and its tokenizer) does too
            masks.bits = self._new_bits(len(rows))
            masks.early = self._masker().submit(self._fill, ready, masks.bits)
        return masks

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[str], masks: StepMasks) -> None:
        """Sets to -inf, in place, every logit a row's grammar does not allow next; rows of
        ``seq_ids`` without a matcher are left alone."""
        masks.wait()
        at = {s: i for i, s in enumerate(masks.seq_ids)}
        rows = [(row, s) for row, s in enumerate(seq_ids) if s in at and s in self._matchers]
        if not rows:
            return
        if masks.bits is None:
            masks.bits = self._new_bits(len(masks.seq_ids))
        late = [(self._matchers[s], at[s]) for _, s in rows if at[s] not in masks.filled]
        if late:  # compiled during the forward
            self._fill(late, masks.bits)
        vocab = logits.shape[-1]
        allowed = np.unpackbits(masks.bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = allowed.astype(bool)
        if allowed.shape[1] < vocab:
            allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
        picked = [self._or_eos(self._matchers[s], allowed[at[s]]) for _, s in rows]
        index = torch.tensor([row for row, _ in rows], device=logits.device)
        blocked = torch.from_numpy(~np.stack(picked)).to(logits.device)
        logits[index] = logits[index].masked_fill_(blocked, float("-inf"))

    def finish(self, masks: StepMasks | None) -> None:
        """Waits for the step's early fill, if any, however the step ended."""
        if masks is not None and masks.early is not None:
            concurrent.futures.wait([masks.early])

    def advance(self, seq_id: str, token: int) -> None:
        matcher = self._matchers.get(seq_id)
        if matcher is not None:
            matcher.consume_token(token)

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

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], bits: np.ndarray) -> None:
        if self._executor is None:
            threads = self.options.num_mask_threads or None
            self._executor = llguidance.LLExecutor(threads)
        fill_next_token_bitmask_par(self._executor, rows, bits)

    def _or_eos(self, matcher: llguidance.LLMatcher, allowed: np.ndarray) -> np.ndarray:
        if matcher.is_error() or not allowed.any():
            # a matcher that can go nowhere ends the sequence rather than emit free text
            allowed = np.zeros_like(allowed)
            allowed[[e for e in self.eos_ids if e < len(allowed)]] = True
        return allowed


def _name_limit(message: str) -> str:
    """``message``, followed by the worker flag of the limit it reports breaking."""
    lowered = message.lower()
    for words, flag in _LIMIT_FLAGS:
        if words in lowered:
            return f"{message} (the worker's {flag})"
    return message
