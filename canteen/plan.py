"""The step plan between scheduler and worker, as plain domain objects (no protobuf, no torch).

A new sequence is sent once with its tokens and blocks; later steps name it by id with the
number of tokens to compute and any new blocks. Sampled tokens never travel back to the
worker: it appends them itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from canteen.adapters import AdapterRef

MAX_TOP_LOGPROBS = 20  # most alternatives a sequence may ask for per token
MAX_TEMPERATURE = 2.0  # OpenAI's bound; hotter sampling is noise
MAX_TOP_K = 1 << 20  # far above any vocabulary; keeps the value an int32
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000  # higher runs first; keys may cap it lower
MAX_STREAM_INTERVAL = 64  # most tokens a streamed message may gather (1 = each its own)


GREEDY_BELOW_TEMPERATURE = 1e-5

CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 512 * 1024  # a schema, regex or grammar; choices count all options
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """What the output must match, as the client wrote it (compiled by canteen/grammar.py).

    ``text`` is the JSON schema, regex or grammar; ``choices`` the options of a choice; a
    ``json_object`` constraint has neither. ``converted`` is the same constraint as the
    grammar engine's text, set by the gateway (which converts each constraint once) for the
    worker to build its matcher from; "" where no gateway converted it (the worker converts).
    It is derived from the rest, so equality and hashing (the compile caches' keys) ignore it.
    """

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    converted: str = field(default="", compare=False, repr=False)

    def problem(self) -> str | None:
        """Shape errors only (kind, sizes, JSON syntax); the grammar engine checks the rest."""
        if self.kind not in CONSTRAINT_KINDS:
            return f"constraint kind {self.kind!r}: must be one of {', '.join(CONSTRAINT_KINDS)}"
        size = len(self.text) + sum(len(c) for c in self.choices)
        if size > MAX_CONSTRAINT_CHARS:
            return f"{self.kind} has {size} characters; the limit is {MAX_CONSTRAINT_CHARS}"
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                return f"choice has {len(self.choices)} options; must be 1..{MAX_CHOICES}"
            if not all(self.choices):
                return "choice: options must not be empty strings"
        elif self.kind in ("regex", "grammar") and not self.text:
            return f"{self.kind} must not be empty"
        elif self.kind == "json_schema" and not self.converted:
            # (with grammar text the gateway parsed it already: the scheduler and the worker
            # do not parse a large schema again; the worker's engine reads the text anyway)
            try:
                schema = json.loads(self.text)
            except ValueError as exc:
                return f"json_schema is not valid JSON: {exc}"
            if not isinstance(schema, dict | bool):
                return "json_schema must be a JSON object"
        return None


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its tokens; the draw at a position depends on (seed, position)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    top_logprobs: int = 0
    constraint: Constraint | None = None

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflow float32 into inf and NaN probabilities;
        # sampling that cold is argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def problem(self) -> str | None:
        """What is out of bounds, naming the field and the rule; None when all is valid.

        The one set of bounds that the gateway, the scheduler and the worker each check.
        """
        t, p = self.temperature, self.top_p
        if not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
            return f"temperature={t}: must be in [0, {MAX_TEMPERATURE:g}]"
        if not (math.isfinite(p) and 0 < p <= 1):
            return f"top_p={p}: must be in (0, 1]"
        if not 0 <= self.top_k <= MAX_TOP_K:
            return f"top_k={self.top_k}: must be in 0..{MAX_TOP_K}"
        if not 0 <= self.seed < 1 << 64:
            return f"seed={self.seed}: must be in 0..2**64-1"
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            return f"top_logprobs={self.top_logprobs}: must be in 0..{MAX_TOP_LOGPROBS}"
        if self.constraint is not None:
            return self.constraint.problem()
        return None


@dataclass(frozen=True)
class NewSequence:
    seq_id: str
    token_ids: tuple[int, ...]
    sampling: Sampling
    block_ids: tuple[int, ...]
    num_cached_tokens: int = 0
    traceparent: str = ""  # W3C trace context of the request; empty when untraced
    request_id: str = ""  # the client's label, for log lines only
    num_prompt_tokens: int = 0  # of token_ids; the rest were generated before a resume
    adapter: AdapterRef | None = None  # the LoRA adapter; None: the base model


@dataclass(frozen=True)
class ScheduledSequence:
    seq_id: str
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0  # most draft tokens to propose and verify (speculation)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    new_sequences: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledSequence, ...] = ()
    dropped_seq_ids: tuple[str, ...] = ()
    # KV tiers (docs/kv-tiers.md): blocks copied down before the step, and back up into
    # fresh blocks before its forward; block_ids[i] goes with keys[i]
    offload_block_ids: tuple[int, ...] = ()
    offload_keys: tuple[bytes, ...] = ()
    reload_block_ids: tuple[int, ...] = ()
    reload_keys: tuple[bytes, ...] = ()

    @property
    def offloads(self) -> list[tuple[int, bytes]]:
        return list(zip(self.offload_block_ids, self.offload_keys, strict=True))

    @property
    def reloads(self) -> list[tuple[int, bytes]]:
        return list(zip(self.reload_block_ids, self.reload_keys, strict=True))

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def kind(self) -> str:
        """``prefill`` when the step computes any prompt tokens, else ``decode`` (metrics)."""
        has_prefill = self.num_tokens > len(self.scheduled) or bool(self.new_sequences)
        return "prefill" if has_prefill else "decode"


@dataclass(frozen=True)
class SampledToken:
    seq_id: str
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most likely (token, logprob), when asked


@dataclass(frozen=True)
class FailedSequence:
    """A sequence the worker refused: it dropped it and ran the rest of the step."""

    seq_id: str
    error: str
    is_request_error: bool = False  # the request's own fault (its grammar), not the plan's


@dataclass(frozen=True)
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...] = ()
    num_tokens: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    total_ns: int = 0
    failed: tuple[FailedSequence, ...] = ()
    num_draft_tokens: int = 0  # proposed and verified this step
    num_accepted_tokens: int = 0
    # draft tokens proposed per sequence granted drafts (0: it had none to propose)
    num_proposed: dict[str, int] = field(default_factory=dict)
    # ids of the adapters loaded on the worker after this step, when the set changed
    resident_adapters: tuple[str, ...] = ()
    adapters_changed: bool = False
    # KV tiers: keys that left host for disk, keys gone from every tier, failed reloads
    tier_moved_keys: tuple[bytes, ...] = ()
    tier_dropped_keys: tuple[bytes, ...] = ()
    reload_failed_keys: tuple[bytes, ...] = ()
    # sequences of the plan whose grammar was still compiling when they would have sampled:
    # the worker undid their part of the step (nothing computed, nothing sampled)
    deferred_seq_ids: tuple[str, ...] = ()
