"""The worker's KV tiers alone: host LRU, disk files (checksum, torn and foreign files,
restart, full and read-only folders), the copies between a pool and a tier (a step's reloads
in one batch, with the tokens of a recompute) and the background disk writer (a write that
fails or a process killed mid-write leaves no torn block)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan
from tests.support import reference
from worker.engine.guard import BlockLedger
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.kv_tiers.disk import DiskTier
from worker.kv_tiers.host import HostTier, TierBlock
from worker.kv_tiers.store import KVTiers, move, version_digest
from worker.model.loader import LoadedModel, load_model

V1 = version_digest("tiny", "v1", "float32", 8)
V2 = version_digest("tiny", "v2", "float32", 8)
BS = 8


def _block(i: int, size: int = 100) -> TierBlock:
    return TierBlock(bytes([i]) * 16, bytes([i % 256]) * size)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_host_tier_evicts_the_least_recently_used_and_returns_it() -> None:
    host = HostTier(300)
    assert host.put(_key(1), _block(1)) == []
    assert host.put(_key(2), _block(2)) == []
    assert host.put(_key(3), _block(3)) == []
    assert host.get(_key(1)) == _block(1)  # 1 is now the most recent
    evicted = host.put(_key(4), _block(4))
    assert evicted == [(_key(2), _block(2))]
    assert (len(host), host.num_bytes) == (3, 300)
    assert host.put(_key(5), _block(5, 301)) == [(_key(5), _block(5, 301))]  # never fits


def test_host_tier_drops_a_block_whose_bytes_changed() -> None:
    host = HostTier(1000)
    payload = bytearray(b"x" * 100)
    host.put(_key(1), TierBlock(b"c" * 16, payload))  # type: ignore[arg-type]
    payload[7] ^= 1  # memory changed under the tier
    assert host.get(_key(1)) is None
    assert _key(1) not in host and host.num_bytes == 0


def test_disk_tier_round_trip_survives_a_restart_of_the_same_version_only(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10_000, V1)
    assert disk.put(_key(1), _block(1)) == []
    assert disk.put(_key(2), _block(2)) == []
    again = DiskTier(tmp_path, 10_000, V1)
    assert sorted(again.keys()) == [_key(1), _key(2)]
    assert again.get(_key(2)) == _block(2)
    other = DiskTier(tmp_path, 10_000, V2)  # another model version shares the folder
    assert other.keys() == [] and other.get(_key(1)) is None
    assert DiskTier(tmp_path, 10_000, V1).get(_key(1)) == _block(1)  # left alone


def test_disk_tier_refuses_and_deletes_a_flipped_or_truncated_block(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10_000, V1)
    disk.put(_key(1), _block(1))
    disk.put(_key(2), _block(2))
    path = disk.path(_key(1))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    assert disk.get(_key(1)) is None
    assert not path.exists() and disk.num_errors == 1
    path2 = disk.path(_key(2))
    path2.write_bytes(path2.read_bytes()[:50])
    assert disk.get(_key(2)) is None and not path2.exists()
    assert len(disk) == 0 and disk.num_bytes == 0


def test_disk_tier_evicts_least_recent_files_within_its_bytes(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * (100 + 86), V1)  # three 100-byte blocks with headers
    for i in (1, 2, 3):
        assert disk.put(_key(i), _block(i)) == []
    assert disk.get(_key(1)) is not None
    assert disk.put(_key(4), _block(4)) == [_key(2)]
    assert not disk.path(_key(2)).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{_key(i).hex()}.kv" for i in (1, 3, 4)
    )


def test_a_full_or_failing_disk_drops_the_block_without_raising(tmp_path: Path) -> None:
    tiny = DiskTier(tmp_path / "tiny", 50, V1)  # smaller than one block
    assert tiny.put(_key(1), _block(1)) == [_key(1)]
    assert list((tmp_path / "tiny").iterdir()) == []
    folder = tmp_path / "gone"
    disk = DiskTier(folder, 10_000, V1)
    disk.put(_key(1), _block(1))
    shutil.rmtree(folder)
    folder.write_bytes(b"")  # every write and read now fails with an OSError (even as root)
    assert disk.put(_key(2), _block(2)) == [_key(2)]
    assert disk.get(_key(1)) is None
    assert disk.num_errors == 2 and len(disk) == 0


def test_two_disk_tiers_on_one_folder_share_blocks(tmp_path: Path) -> None:
    a, b = DiskTier(tmp_path, 10_000, V1), DiskTier(tmp_path, 10_000, V1)
    a.put(_key(9), _block(9))
    assert b.get(_key(9)) == _block(9)  # a block one worker wrote is a hit for the other
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def _pool(num_blocks: int = 4) -> torch.Tensor:
    # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return torch.randn(2, 2, num_blocks, 8, 2, 4)


def test_offload_then_reload_copies_a_block_exactly_and_teaches_the_ledger(
    tmp_path: Path,
) -> None:
    pool = _pool()
    ledger = BlockLedger(4, 8, 100)
    keys: list[bytes] = []
    ledger.computed([1], list(range(8)), keys, 8)
    tiers = KVTiers(host_bytes=0, disk=DiskTier(tmp_path, 1 << 20, V1), version=V1)
    report = move(tiers, pool, ledger, [(1, _key(1))], [], True)
    assert report.tier_moved_keys == [_key(1)]  # no host room: straight to disk
    heads = pool.view(2, 2, 2, 4 * 8, 4)  # the head-major view of Canteen's forward
    want = heads[:, :, :, 8:16].clone()
    pool.zero_()
    report = move(tiers, pool, ledger, [], [(3, _key(1))], True)
    assert report.reload_failed_keys == []
    assert torch.equal(heads[:, :, :, 24:32], want)
    assert int((pool != 0).sum()) == want.numel()  # nothing else written
    assert ledger.key_of(3) == keys[0]


def test_a_reload_of_a_missing_block_or_into_a_held_block_fails() -> None:
    pool = _pool()
    ledger = BlockLedger(4, 8, 100)
    tiers = KVTiers(host_bytes=1 << 20)
    ledger.computed([0], list(range(8)), [], 8)
    move(tiers, pool, ledger, [(0, _key(1))], [], False)
    ledger.hold([2])
    before = pool.clone()
    report = move(tiers, pool, ledger, [], [(2, _key(1)), (3, _key(7))], False)
    assert report.reload_failed_keys == [_key(1), _key(7)]
    assert torch.equal(pool, before) and ledger.key_of(3) is None


def test_an_offload_of_a_block_never_computed_here_is_reported_dropped() -> None:
    tiers = KVTiers(host_bytes=1 << 20)
    report = move(tiers, _pool(), BlockLedger(4, 8, 100), [(2, _key(5))], [], False)
    assert report.tier_dropped_keys == [_key(5)] and len(tiers.host) == 0


# -- batched reloads and the background disk writer ------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(
        str(tiny_model_dir), "safetensors", "", torch.device("cpu"), torch.float32, False
    )


def _greedy_after(runner: ModelRunner, seq_id: str, first: int, steps: int) -> list[int]:
    out = [first]
    for i in range(steps):
        result = runner.step(StepPlan(100 + i, scheduled=(ScheduledSequence(seq_id, 1),)))
        out += [t.token_id for t in result.tokens if t.seq_id == seq_id]
    return out


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_batched_reload_gives_the_tokens_of_a_recompute(
    tier: str, loaded: LoadedModel, tiny_model_dir: Path, tmp_path: Path
) -> None:
    runner = ModelRunner(loaded, RunnerConfig(16, BS, max_batched_tokens=256))
    disk = DiskTier(tmp_path, 1 << 22, V1) if tier == "disk" else None
    runner.tiers = KVTiers(host_bytes=(1 << 22) * (tier == "host"), disk=disk, version=V1)
    prompt = [(i * 13) % 190 + 5 for i in range(4 * BS + 3)]  # four full blocks
    greedy = Sampling(temperature=0.0)
    first = NewSequence("a", tuple(prompt), greedy, (0, 1, 2, 3, 4), 0)
    runner.step(StepPlan(1, (first,), (ScheduledSequence("a", len(prompt)),)))
    keys = tuple(_key(20 + i) for i in range(4))
    runner.step(
        StepPlan(2, dropped_seq_ids=("a",), offload_block_ids=(0, 1, 2, 3), offload_keys=keys)
    )
    runner.kv_pool.zero_()  # only the tier holds the prefix now
    again = NewSequence("b", tuple(prompt), greedy, (9, 7, 12, 5, 6), 4 * BS)
    result = runner.step(
        StepPlan(
            3,
            (again,),
            (ScheduledSequence("b", 3),),
            reload_block_ids=(9, 7, 12, 5),  # four blocks, in one copy, not in pool order
            reload_keys=keys,
        )
    )
    assert result.failed == () and result.reload_failed_keys == ()
    [token] = [t.token_id for t in result.tokens]
    assert _greedy_after(runner, "b", token, 5) == reference.greedy(tiny_model_dir, prompt, 6)
    assert runner.tiers.num_reloads == 4


def test_a_failed_background_write_reports_the_block_dropped_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskTier(tmp_path, 1 << 20, V1)
    tiers = KVTiers(host_bytes=0, disk=disk, version=V1)
    real_write = disk._write

    def crash_on_key_2(key: bytes, block: TierBlock) -> bool:
        if key == _key(2):
            raise RuntimeError("writer bug")
        return real_write(key, block)

    monkeypatch.setattr(disk, "_write", crash_on_key_2)
    for i in (1, 2, 3):
        tiers.put(_key(i), _block(i))
    assert tiers.take_report().tier_moved_keys == [_key(1), _key(2), _key(3)]
    assert tiers.writer is not None
    tiers.writer.flush()
    assert tiers.take_report().tier_dropped_keys == [_key(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{_key(i).hex()}.kv" for i in (1, 3)
    )  # the writer went on after the failure
    assert DiskTier(tmp_path, 1 << 20, V1).get(_key(3)) == _block(3)


CRASH_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from worker.kv_tiers import disk as disk_module
from worker.kv_tiers.disk import DiskTier
from worker.kv_tiers.host import TierBlock
from worker.kv_tiers.store import KVTiers

folder, version = Path(sys.argv[1]), bytes.fromhex(sys.argv[2])
tiers = KVTiers(0, DiskTier(folder, 1 << 20, version), version)
tiers.put(b"w" * 16, TierBlock(b"c" * 16, b"x" * 50_000))
tiers.writer.flush()


class Torn:
    def __init__(self, path, mode):
        self.file = open(path, mode)
        self.written = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, data):
        self.written += 1
        if self.written == 2:  # the payload: half of it reaches the disk, then power fails
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            os.fsync(self.file.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        self.file.write(data)


disk_module.open = Torn
tiers.put(b"t" * 16, TierBlock(b"d" * 16, b"y" * 50_000))
tiers.writer.flush()
"""


def test_a_process_killed_mid_write_leaves_no_torn_block(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", CRASH_MID_WRITE, str(folder), V1.hex()], env=env, timeout=120
    )
    assert done.returncode == -signal.SIGKILL
    assert any(p.name.endswith(".tmp") for p in folder.iterdir())  # it died mid-write
    reader = DiskTier(folder, 1 << 20, V1)
    assert reader.keys() == [b"w" * 16]  # the whole block, never the torn one
    assert reader.get(b"t" * 16) is None
    assert reader.get(b"w" * 16) == TierBlock(b"c" * 16, b"x" * 50_000)


def test_reads_started_on_arrival_serve_the_reload_and_none_is_left_behind(
    tmp_path: Path,
) -> None:
    pool = _pool()
    ledger = BlockLedger(4, 8, 100)
    ledger.computed([1], list(range(8)), [], 8)
    disk = DiskTier(tmp_path, 1 << 20, V1)
    tiers = KVTiers(host_bytes=0, disk=disk, version=V1)
    move(tiers, pool, ledger, [(1, _key(1))], [], False)
    assert tiers.writer is not None
    tiers.writer.flush()
    want = pool[:, :, 1].clone()
    pool.zero_()
    ledger.hold([2])
    tiers.prefetch((_key(1), _key(9)))  # as the plan arrives, while another step runs
    disk.path(_key(1)).unlink()  # served from the bytes read ahead
    report = move(tiers, pool, ledger, [], [(3, _key(1)), (2, _key(9))], False)
    assert report.reload_failed_keys == [_key(9)]  # block 2 is held: never overwritten
    assert torch.equal(pool[:, :, 3], want)
    assert tiers.writer._reads == {}


def test_a_reload_into_the_blocks_of_a_sequence_the_same_plan_drops_runs(
    loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    """The scheduler hands a finished sequence's blocks out again in the plan that drops it
    (KVManager.release_early): the reload must not find them still held."""
    runner = ModelRunner(loaded, RunnerConfig(16, BS, max_batched_tokens=256))
    runner.tiers = KVTiers(host_bytes=1 << 22)
    prompt = [(i * 7) % 180 + 9 for i in range(4 * BS + 3)]
    greedy = Sampling(temperature=0.0)
    first = NewSequence("a", tuple(prompt), greedy, (0, 1, 2, 3, 4), 0)
    runner.step(StepPlan(1, (first,), (ScheduledSequence("a", len(prompt)),)))
    keys = tuple(_key(40 + i) for i in range(4))
    runner.step(StepPlan(2, offload_block_ids=(0, 1, 2, 3), offload_keys=keys))
    runner.kv_pool.zero_()
    again = NewSequence("b", tuple(prompt), greedy, (4, 3, 2, 1, 0), 4 * BS)
    result = runner.step(
        StepPlan(
            3,
            (again,),
            (ScheduledSequence("b", 3),),
            dropped_seq_ids=("a",),
            reload_block_ids=(4, 3, 2, 1),  # "a" held them until this plan
            reload_keys=keys,
        )
    )
    assert result.failed == () and result.reload_failed_keys == ()
    [token] = [t.token_id for t in result.tokens]
    assert _greedy_after(runner, "b", token, 5) == reference.greedy(tiny_model_dir, prompt, 6)


def test_a_block_offloaded_by_the_plan_that_reloads_it_is_found_after_an_early_read(
    tmp_path: Path,
) -> None:
    """The scheduler may evict a block for a reload and reload it in the same plan: the read
    started on arrival finds no file, the step's offload then writes it."""
    pool = _pool()
    ledger = BlockLedger(4, 8, 100)
    ledger.computed([1], list(range(8)), [], 8)
    tiers = KVTiers(host_bytes=0, disk=DiskTier(tmp_path, 1 << 20, V1), version=V1)
    assert tiers.writer is not None
    want = pool[:, :, 1].clone()
    tiers.prefetch((_key(1),))  # the plan arrives: nothing on disk yet
    tiers.writer.flush()
    move(tiers, pool, ledger, [(1, _key(1))], [], False)  # the step's offload
    tiers.writer.flush()  # written and no longer queued before the reload looks
    report = move(tiers, pool, ledger, [], [(3, _key(1))], False)
    assert report.reload_failed_keys == []
    assert torch.equal(pool[:, :, 3], want)
