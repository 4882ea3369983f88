"""One request as the scheduler tracks it: tokens, blocks, progress, and how it ended."""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field

from canteen.finish import Finish
from canteen.plan import Sampling
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
    error: str = ""
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
    is_refused: bool = False  # a worker refused its plan entry: it failed alone
    cache_salt: str = ""  # its prefix-cache tenant; "" shares with every other request
    allow_speculation: bool = True  # the request may verify draft tokens
    drafting: DraftRecord = field(default_factory=DraftRecord)  # how its drafts hold
    # The key on the worker and in every table: made here, unique.
    seq_id: str = field(default_factory=new_seq_id)
    # Pipelined steps: what plans the worker has not answered yet will compute and sample.
    num_in_flight: int = 0
    num_pending_samples: int = 0
    num_drafts_in_flight: int = 0  # drafts granted to plans in flight: each may hold or not
    incarnation: int = 0  # bumped each time it is sent to a worker as new

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

    # -- as the next plan sees it, assuming the plans in flight come back -------------------

    @property
    def num_scheduled(self) -> int:
        """Tokens computed, or being computed by a plan in flight."""
        return self.num_computed + self.num_in_flight

    @property
    def num_unscheduled(self) -> int:
        """Tokens known once the plans in flight return that no plan computes yet."""
        return self.num_tokens + self.num_pending_samples - self.num_scheduled

    @property
    def is_decoding_ahead(self) -> bool:
        """Past its prompt once the plans in flight return: one token a step."""
        has_output = bool(self.output_ids) or self.num_pending_samples > 0
        return has_output and self.num_unscheduled == 1

    @property
    def is_done_ahead(self) -> bool:
        """The plans in flight already sample its last allowed token."""
        return self._done_after(self.num_pending_samples)

    @property
    def num_samples_at_most(self) -> int:
        """Tokens the plans in flight sample if every draft in them holds."""
        return self.num_pending_samples + self.num_drafts_in_flight

    @property
    def num_scheduled_at_most(self) -> int:
        """``num_scheduled`` if every draft in flight holds: what its blocks must cover."""
        return self.num_scheduled + self.num_drafts_in_flight

    @property
    def may_be_done_ahead(self) -> bool:
        """The plans in flight sample its last allowed token if their drafts all hold."""
        return self._done_after(self.num_samples_at_most)

    def _done_after(self, num_samples: int) -> bool:
        """Whether ``num_samples`` more sampled tokens reach max_tokens or the context."""
        num_output = len(self.output_ids) + num_samples
        return num_output >= self.max_tokens or self.num_tokens + num_samples >= self.max_model_len

    def forget_in_flight(self) -> None:
        """Results of plans sent before now no longer apply (preempted, finished, lost)."""
        self.num_in_flight = self.num_pending_samples = self.num_drafts_in_flight = 0

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class SeqEvent:
    """What a step did to one sequence: new tokens, and its end when it ended."""

    seq: Sequence
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish: Finish | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()

    def then(self, more: SeqEvent) -> SeqEvent:
        """This event's tokens followed by ``more``'s, ending as ``more`` does."""
        return SeqEvent(
            self.seq,
            self.token_ids + more.token_ids,
            self.logprobs + more.logprobs,
            more.finish,
            self.top_logprobs + more.top_logprobs,
        )
