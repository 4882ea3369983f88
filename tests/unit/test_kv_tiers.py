"""The worker's KV tiers alone: host LRU, disk files (checksum, torn and foreign files,
restart, full and read-only folders) and the copies between a pool and a tier."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from worker.engine.guard import BlockLedger
from worker.kv_tiers.disk import DiskTier
from worker.kv_tiers.host import HostTier, TierBlock
from worker.kv_tiers.store import KVTiers, move, version_digest

V1 = version_digest("tiny", "v1", "float32", 8)
V2 = version_digest("tiny", "v2", "float32", 8)


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
