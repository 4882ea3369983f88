"""The scheduler's side of the KV tiers: offloads when the pool hands a cached block out
again, reloads of an evicted prefix into fresh blocks, recompute when a reload fails, the
tenant salt, and routing by the longest prefix in any tier. The fake worker keeps real slot
contents (tests/unit/test_prefix_cache.py), so a wrong reload changes the tokens."""

from __future__ import annotations

from dataclasses import replace

from canteen.batching import BatchConfig
from canteen.finish import Finish
from canteen.plan import FailedSequence, StepPlan, StepResult
from scheduler.batcher import BatchScheduler
from scheduler.blocks import BlockPool
from scheduler.router import pick_worker
from scheduler.tiers import DISK, HOST, TierIndex
from tests.unit.test_prefix_cache import BS, ONE_AT_A_TIME, KVWorker, expected, run, seq

PREFIX = list(range(40, 52))  # three full blocks


class TieredWorker(KVWorker):
    """Offloads and reloads slot contents as the plan says; ``broken`` keys fail to reload
    (the worker's checksum refused them) and the sequences needing them are refused."""

    def __init__(self) -> None:
        super().__init__()
        self.tier: dict[bytes, list[int]] = {}
        self.broken: set[bytes] = set()
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for block, key in plan.offloads:
            self.tier[key] = [self.slots.get(block * BS + i, -1) for i in range(BS)]
        failed_keys, failed_blocks = [], set()
        for block, key in plan.reloads:
            if key in self.broken or key not in self.tier:
                failed_keys.append(key)
                failed_blocks.add(block)
                continue
            for i, token in enumerate(self.tier[key]):
                self.slots[block * BS + i] = token
        refused = [n.seq_id for n in plan.new_sequences if failed_blocks & set(n.block_ids)]
        clean = replace(
            plan,
            new_sequences=tuple(n for n in plan.new_sequences if n.seq_id not in refused),
            scheduled=tuple(s for s in plan.scheduled if s.seq_id not in refused),
        )
        result = super().step(clean)
        return replace(
            result,
            failed=tuple(FailedSequence(i, "block does not hold its tokens") for i in refused),
            reload_failed_keys=tuple(failed_keys),
        )


def make(num_blocks: int = 6, salt: str = "m:v1") -> BatchScheduler:
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=True, cache_salt=salt)
    limits = BatchConfig(max_batched_tokens=64, max_num_seqs=8, **ONE_AT_A_TIME)
    return BatchScheduler(pool, limits, tiers=TierIndex())


def _evict(sched: BatchScheduler, worker: TieredWorker) -> None:
    """Runs a prompt that needs the whole pool: every cached block is handed out again."""
    size = (sched.pool.num_blocks - 1) * BS - 1  # the watermark's block stays free at first
    filler = seq("filler", list(range(200, 200 + size)), max_tokens=2)
    sched.add(filler)
    run(sched, worker)


def test_an_evicted_prefix_is_offloaded_then_reloaded_with_exact_tokens() -> None:
    sched, worker = make(), TieredWorker()
    first = seq("a", [*PREFIX, 1, 2])
    sched.add(first)
    run(sched, worker)
    _evict(sched, worker)
    assert sched.pool.count_cached_prefix([*PREFIX, 3]) == 0  # gone from the pool
    assert sched.kv.count_cached_prefix([*PREFIX, 3]) == 3  # held by the tiers
    offloaded = [k for p in worker.plans for k in p.offload_keys]
    assert len(offloaded) >= 3 and sched.kv.tiers is not None
    second = seq("b", [*PREFIX, 1, 2])
    sched.add(second)
    run(sched, worker)
    assert second.output_ids == first.output_ids == expected(first.prompt_ids, 6)
    assert second.num_cached_tokens == 12 and worker.new_cached["b"] == 12
    reloads = [r for p in worker.plans for r in p.reloads]
    assert len(reloads) == 3
    # confirmed reloads join the pool's prefix cache: a third copy shares them
    assert sched.pool.count_cached_prefix([*PREFIX, 9]) == 3


def test_a_failed_reload_is_recomputed_never_failed() -> None:
    sched, worker = make(), TieredWorker()
    sched.add(seq("a", [*PREFIX, 1, 2]))
    run(sched, worker)
    _evict(sched, worker)
    worker.broken = set(worker.tier)  # every block the tiers hold fails its checksum
    again = seq("b", [*PREFIX, 1, 2])
    sched.add(again)
    run(sched, worker)
    assert again.finish is Finish.LENGTH
    assert again.output_ids == expected(again.prompt_ids, 6)
    assert again.num_preemptions == 1  # the refused attempt, then a plain recompute
    assert again.num_cached_tokens == 0  # what it really reused
    assert sched.kv.count_cached_prefix([*PREFIX, 3]) == 3  # recomputed: cached in the pool
    index = sched.kv.tiers
    assert index is not None and index.num_failed_reloads >= 1


def test_another_tenant_never_hits_the_tiers() -> None:
    sched, worker = make(), TieredWorker()
    sched.add(seq("a", [*PREFIX, 1, 2]))
    run(sched, worker)
    _evict(sched, worker)
    other = seq("b", [*PREFIX, 1, 2])
    other.cache_salt = "tenant-2"
    assert sched.kv.count_cached_prefix(other.tokens, "tenant-2") == 0
    sched.add(other)
    run(sched, worker)
    assert other.num_cached_tokens == 0 and worker.plans[-1].reload_keys == ()
    assert all(not p.reloads for p in worker.plans if any(n.seq_id == "b" for n in p.new_sequences))


def test_the_index_follows_the_workers_reports() -> None:
    index = TierIndex()
    index.offloaded(b"a" * 16)
    index.offloaded(b"b" * 16)
    index.apply(moved=(b"a" * 16,), dropped=(b"b" * 16,))
    assert (index.tier_of(b"a" * 16), index.tier_of(b"b" * 16)) == (DISK, None)
    index.offloaded(b"c" * 16)
    assert index.tier_of(b"c" * 16) == HOST
    shared_a, shared_b = TierIndex("node:/kv", (b"d" * 16,)), TierIndex("node:/kv")
    assert shared_b.tier_of(b"d" * 16) == DISK and shared_a.disk is shared_b.disk


def test_routing_prefers_the_worker_whose_tiers_hold_the_longest_prefix() -> None:
    cold, warm = make(num_blocks=8), make(num_blocks=6)
    worker = TieredWorker()
    warm.add(seq("a", [*PREFIX, 1, 2]))
    run(warm, worker)
    _evict(warm, worker)
    assert warm.pool.count_cached_prefix([*PREFIX, 5]) == 0
    assert pick_worker([cold, warm], [*PREFIX, 5]) == 1  # cold has more room
    assert pick_worker([cold, warm], [*PREFIX, 5], "tenant-2") == 0


def test_a_prefix_half_in_the_tiers_half_still_in_the_pool_is_reused_whole() -> None:
    sched, worker = make(num_blocks=8), TieredWorker()
    first = seq("a", [*PREFIX, 1, 2])
    sched.add(first)
    run(sched, worker)
    # "a" left 4 cached blocks and 4 empty ones: a filler of 5 blocks takes the empty ones
    # and evicts only the least recent cached one, the prefix's first block
    filler = seq("filler", list(range(300, 318)), max_tokens=2)
    sched.add(filler)
    run(sched, worker)
    assert sched.pool.count_cached_prefix([*PREFIX, 3]) == 0  # its head is gone from the pool
    assert sched.kv.count_cached_prefix([*PREFIX, 3]) == 3  # head in the tiers, tail cached
    second = seq("b", [*PREFIX, 1, 2])
    sched.add(second)
    run(sched, worker)
    assert second.output_ids == first.output_ids == expected(first.prompt_ids, 6)
    assert second.num_cached_tokens == 12
    assert len([r for p in worker.plans for r in p.reloads]) == 1  # the head only


def test_a_restarted_scheduler_routes_to_the_host_tier_the_worker_reports() -> None:
    warm, worker = make(num_blocks=6), TieredWorker()
    first = seq("a", [*PREFIX, 1, 2])
    warm.add(first)
    run(warm, worker)
    _evict(warm, worker)
    # The scheduler restarts: its pools start empty; the worker's GetInfo names its host tier.
    cold = make(num_blocks=8)
    pool = BlockPool(6, BS, enable_prefix_cache=True, cache_salt="m:v1")
    limits = BatchConfig(max_batched_tokens=64, max_num_seqs=8, **ONE_AT_A_TIME)
    restarted = BatchScheduler(pool, limits, tiers=TierIndex(host_keys=tuple(worker.tier)))
    assert restarted.kv.count_cached_prefix([*PREFIX, 5]) == 3
    assert pick_worker([cold, restarted], [*PREFIX, 5]) == 1  # cold has more room
    second = seq("b", [*PREFIX, 1, 2])
    restarted.add(second)
    run(restarted, worker)
    assert second.output_ids == first.output_ids == expected(first.prompt_ids, 6)
    assert second.num_cached_tokens == 12
