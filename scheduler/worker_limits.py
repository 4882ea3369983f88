"""What the scheduler believes of a worker's description (GetInfo) before it sends it work.

A worker's certificate proves who it is, not that what it reports is sane: every number in
WorkerInfo (read by name into ``WorkerDescription``, scheduler/link.py) is checked against
the table below (``num_blocks`` near 2**31 would have the scheduler build a block list it
cannot hold), its id, model and version against the registry's directory entry, and the
model version against the registry's model list. A refused worker gets no link and no
traffic; the reason names the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from canteen.v1 import registry_pb2
from scheduler.blocks import MAX_NUM_BLOCKS

if TYPE_CHECKING:
    from scheduler.link import WorkerDescription


@dataclass(frozen=True)
class Bound:
    """An inclusive range for one integer field of WorkerInfo (and ``WorkerDescription``)."""

    field: str
    low: int
    high: int


_GIB = 1 << 30
# Every number a worker reports, and what the scheduler accepts of it.
WORKER_INFO_BOUNDS = (
    Bound("num_blocks", 1, MAX_NUM_BLOCKS),
    Bound("block_size", 1, 1024),
    Bound("max_model_len", 1, 1 << 22),
    Bound("max_batched_tokens", 1, 1 << 20),
    Bound("vocab_size", 1, 1 << 22),
    Bound("num_speculative_tokens", 0, 64),
    Bound("bytes_per_block", 0, 64 * _GIB),
    Bound("kv_cache_bytes", 0, 1 << 50),
    Bound("memory_budget_bytes", 0, 1 << 50),
    Bound("peak_bytes_before_kv", 0, 1 << 50),
)
MAX_EOS_TOKEN_IDS = 64
# A Unix socket's path on Linux (sun_path, less its NUL): the local link's run_socket.
MAX_RUN_SOCKET_BYTES = 107


def info_refusal(info: WorkerDescription, entry: registry_pb2.WorkerEntry) -> str | None:
    """Why ``info`` (a worker's GetInfo, described) cannot be believed for ``entry``; None
    if it can. Its eos ids are a set, so counted once each."""
    for bound in WORKER_INFO_BOUNDS:
        value = getattr(info, bound.field)
        if not bound.low <= value <= bound.high:
            return f"{bound.field}={value}: must be in {bound.low}..{bound.high}"
    if len(info.eos_token_ids) > MAX_EOS_TOKEN_IDS:
        return f"eos_token_ids: {len(info.eos_token_ids)} ids, at most {MAX_EOS_TOKEN_IDS}"
    bad = next((t for t in info.eos_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        return f"eos_token_ids: {bad} is outside the vocabulary 0..{info.vocab_size - 1}"
    path = info.run_socket
    if path and (not path.startswith("/") or len(path.encode()) > MAX_RUN_SOCKET_BYTES):
        return (
            f"run_socket={path[:120]!r}: must be empty or an absolute path of at most "
            f"{MAX_RUN_SOCKET_BYTES} bytes"
        )
    for field in ("worker_id", "model", "version"):
        reported, listed = getattr(info, field), getattr(entry, field)
        if reported != listed:
            return (
                f"{field}={reported!r}: the registry's directory lists this worker with "
                f"{field}={listed!r}"
            )
    return None


def unlisted_model(info: WorkerDescription) -> str:
    """The refusal for a worker whose model version the registry does not list."""
    return (
        f"model={info.model!r} version={info.version!r}: not in the registry's model list; "
        "a worker serves only a registered model version"
    )
