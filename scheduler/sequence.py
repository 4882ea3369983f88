"""One request as the scheduler tracks it: tokens, blocks, progress, and how it ended."""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field

from canteen.adapters import AdapterRef
from canteen.finish import Finish
from canteen.plan import NewSequence, Sampling
from scheduler.speculation import DraftRecord


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Sequence ids are made here, never taken from a client: a process-unique prefix and a counter.
_SEQ_PREFIX = os.urandom(4).hex()
_seq_counter = itertools.count(1)


def new_seq_id() -> str:
    """A sequence id unique to this scheduler process (and across its restarts)."""
    return f"{_SEQ_PREFIX}-{next(_seq_counter):x}"


@dataclass(eq=False)
class Sequence:
    # The client's label (x-request-id): logged and echoed, never used as a key.
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    max_model_len: int = 1 << 30
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Prefix-cache keys of the leading full, computed blocks.
    block_keys: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish: Finish | None = None
    # Worker-side state of the current Run stream.
    is_on_worker: bool = False
    num_sent_blocks: int = 0
    is_cancel_requested: bool = False
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Results its batcher had applied when it joined, and when its first token came (None
    # before): the stall bound protects only streams that streamed before a prompt arrived.
    arrival_tick: int = 0
    first_token_tick: int | None = None
    first_scheduled_time: float | None = None
    admit_order: int = 0
    traceparent: str = ""
    # Where it runs now (a worker id), and when its caller stops waiting (monotonic).
    worker_id: str = ""
    deadline: float | None = None
    num_failovers: int = 0
    cache_salt: str = ""  # its prefix-cache tenant; "" shares with every other request
    adapter: AdapterRef | None = None  # the LoRA adapter it runs with; None: the base model
    allow_speculation: bool = True  # the request may verify draft tokens
    drafting: DraftRecord = field(default_factory=DraftRecord)  # how its drafts hold
    # The key on the worker and in every table: made here, unique.
    seq_id: str = field(default_factory=new_seq_id)
    incarnation: int = 0  # bumped each time it is sent to a worker as new

    @property
    def prefix_salt(self) -> str:
        """What roots its prefix-cache chain: tenant and adapter (prefix_salt())."""
        return prefix_salt(self.cache_salt, self.adapter)

    @property
    def adapter_id(self) -> str:
        """``name:version`` of its adapter; "" for the base model."""
        return "" if self.adapter is None else self.adapter.id

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last sampled one are in the KV cache."""
        return bool(self.output_ids) and self.num_uncomputed == 1

    def is_done_after(self, num_samples: int) -> bool:
        """Whether ``num_samples`` more sampled tokens reach max_tokens or the context."""
        num_output = len(self.output_ids) + num_samples
        return num_output >= self.max_tokens or self.num_tokens + num_samples >= self.max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def as_new(self) -> NewSequence:
        """The sequence as a worker that does not hold it yet receives it (DESIGN: a new
        sequence is sent once, its tokens, sampling, blocks and cached prefix)."""
        return NewSequence(
            seq_id=self.seq_id,
            token_ids=tuple(self.tokens),
            sampling=self.sampling,
            block_ids=tuple(self.block_ids),
            num_cached_tokens=self.num_computed,
            traceparent=self.traceparent,
            request_id=self.request_id,
            num_prompt_tokens=len(self.prompt_ids),
            adapter=self.adapter,
        )


def prefix_salt(cache_salt: str, adapter: AdapterRef | None) -> str:
    """The prefix-cache salt of a tenant's sequence run with ``adapter``: the same tokens
    make different KV under different adapters, so each adapter (its id and digest: a
    version re-registered with other weights is another adapter) roots its own chain."""
    if adapter is None:
        return cache_salt
    return f"{cache_salt}\0lora:{adapter.id}:{adapter.sha256}"


@dataclass(frozen=True)
class Usage:
    """A sequence's token counts when an event was made (what the final response reports)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class SeqEvent:
    """What a step did to one sequence: new tokens, and its end when it ended. A value: it
    names the sequence by id and carries what readers need, so no reader holds the
    ``Sequence`` that the batcher keeps changing. Never changed once made (not frozen only
    because a frozen dataclass costs several times as much to build, and every step builds
    one per sequence)."""

    seq_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: Finish | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    usage: Usage = Usage(0, 0, 0)
    queue_seconds: float | None = None  # first scheduled minus arrival; None before
    error: str = ""  # why it failed (finish FAILED)
    is_refused: bool = False  # a worker refused its plan entry: it failed alone
    is_request_error: bool = False  # ... because of the request itself (e.g. its grammar)

    @classmethod
    def of(
        cls,
        seq: Sequence,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[float, ...] = (),
        finish: Finish | None = None,
        top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = (),
        error: str = "",
        is_refused: bool = False,
        is_request_error: bool = False,
    ) -> SeqEvent:
        """An event of ``seq`` with its usage and queue time as they are now."""
        started = seq.first_scheduled_time
        return cls(
            seq.seq_id,
            token_ids,
            logprobs,
            finish,
            top_logprobs,
            Usage(len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_tokens),
            None if started is None else started - seq.arrival_time,
            error,
            is_refused,
            is_request_error,
        )

    def then(self, more: SeqEvent) -> SeqEvent:
        """This event's tokens followed by ``more``'s, ending as ``more`` does."""
        return joined((self, more))


def joined(events: list[SeqEvent] | tuple[SeqEvent, ...]) -> SeqEvent:
    """``events`` (of one sequence, in order) as one: their tokens in order, ending as the
    last does, with the latest queue time known. Built in one call, not one per event
    (a stream interval gathers every token of a request through here)."""
    last = events[-1]
    if len(events) == 1:
        return last
    queue_seconds = last.queue_seconds
    if queue_seconds is None:
        queue_seconds = next(
            (e.queue_seconds for e in reversed(events) if e.queue_seconds is not None), None
        )
    return SeqEvent(
        last.seq_id,
        tuple(t for e in events for t in e.token_ids),
        tuple(lp for e in events for lp in e.logprobs),
        last.finish,
        tuple(top for e in events for top in e.top_logprobs),
        last.usage,
        queue_seconds,
        last.error,
        last.is_refused,
        last.is_request_error,
    )
