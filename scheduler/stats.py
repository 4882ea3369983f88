"""What GetStats reports of each worker, as plain values that scheduler/server.py converts
to ``WorkerStats`` / ``RefusedWorker`` by field name (canteen/codec/fields.py)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.link import WorkerLink
from scheduler.router import WorkerPool


@dataclass(frozen=True)
class RunningSequence:
    request_id: str
    seq_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int
    is_decoding: bool


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    address: str
    model: str
    version: str
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_steps: int
    is_ready: bool
    num_preemptions: int
    num_cached_blocks: int
    prefix_cache_hit_rate: float
    num_draft_tokens: int
    num_accepted_tokens: int
    block_map: str  # one character per block (BlockPool.state_map)
    running: tuple[RunningSequence, ...]  # in admission order
    last_batch_size: int
    kv_host_bytes: int = 0  # KV tiers (docs/kv-tiers.md)
    kv_disk_bytes: int = 0
    num_host_tier_blocks: int = 0
    num_disk_tier_blocks: int = 0
    num_tier_offloads: int = 0
    num_tier_reloads: int = 0
    num_failed_reloads: int = 0


@dataclass(frozen=True)
class RefusedWorker:
    worker_id: str
    address: str
    reason: str


def link_stats(link: WorkerLink) -> WorkerStats:
    core, desc = link.core, link.desc
    running = tuple(
        RunningSequence(
            request_id=seq.request_id,
            seq_id=seq.seq_id,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            num_blocks=len(seq.block_ids),
            is_decoding=seq.is_decoding,
        )
        for seq in sorted(core.running, key=lambda s: s.admit_order)
    )
    return WorkerStats(
        worker_id=desc.worker_id,
        address=desc.address,
        model=desc.model,
        version=desc.version,
        num_total_blocks=core.pool.num_blocks,
        num_free_blocks=core.pool.num_free,
        num_running=len(core.running),
        num_waiting=len(core.waiting),
        num_steps=core.num_steps,
        is_ready=link.is_ready,
        num_preemptions=core.num_preemptions,
        num_cached_blocks=core.pool.num_cached,
        prefix_cache_hit_rate=core.prefix_cache_hit_rate,
        num_draft_tokens=core.speculation.num_draft_tokens,
        num_accepted_tokens=core.speculation.num_accepted_tokens,
        block_map=core.pool.state_map(),
        running=running,
        last_batch_size=link.last_batch_size,
        **_tier_stats(link),
    )


def _tier_stats(link: WorkerLink) -> dict[str, int]:
    tiers = link.core.kv.tiers
    if tiers is None:
        return {}
    return {
        "kv_host_bytes": link.desc.kv_host_bytes,
        "kv_disk_bytes": link.desc.kv_disk_bytes,
        "num_host_tier_blocks": len(tiers.host),
        "num_disk_tier_blocks": len(tiers.disk),
        "num_tier_offloads": tiers.num_offloads,
        "num_tier_reloads": tiers.num_reloads,
        "num_failed_reloads": tiers.num_failed_reloads,
    }


def pool_stats(pool: WorkerPool) -> tuple[list[WorkerStats], list[RefusedWorker]]:
    """Every linked worker's stats, and every refused worker with its reason."""
    refused = [RefusedWorker(e.worker_id, e.address, reason) for e, reason in pool.refused.values()]
    return [link_stats(link) for link in pool.links.values()], refused
