"""KV tiers with the real services: a prefix evicted from a small pool comes back from the
host tier, from the disk tier, and from disk after the worker is SIGKILLed and restarted;
a flipped byte in a disk block is refused and the prefix recomputed; a restarted scheduler
learns the host tier from the worker and answers from it. Every answer is the
uncached run's greedy tokens (float32), and cached_tokens says what was reused."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from canteen.v1 import inference_pb2, scheduler_pb2
from tests.integration.conftest import BLOCK_SIZE, TinySuite, tiny_suite
from tests.support import reference
from tests.support.suite import wait_serving

NUM_KV_BLOCKS = 24  # 192 tokens: three filler prompts evict everything cached
PREFIX = "Chat products resend the same long context on every turn of a conversation. " * 2
FILLERS = [f"{word} " * 20 for word in ("alpha", "bravo", "charlie")]


def _ask(suite: TinySuite, prompt: str) -> inference_pb2.CompleteResponse:
    request = inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True
    )
    reply: inference_pb2.CompleteResponse = suite.inference.Complete(request, timeout=60)
    return reply


def _evict(suite: TinySuite) -> None:
    """Three prompts of 13+ blocks each through a 24-block pool: nothing older stays in it
    (a filler reloaded from a tier takes fresh blocks as well)."""
    for filler in FILLERS:
        _ask(suite, filler)


def _full_blocks(model_dir: Path) -> int:
    ids = reference.tokenizer(model_dir)(PREFIX, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert 64 <= len(ids) < 120, len(ids)
    return (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def host(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinySuite]:
    args = ("--kv-host-bytes", "1MiB")
    workdir = tmp_path_factory.mktemp("host")
    with tiny_suite(workdir, tiny_model_dir, NUM_KV_BLOCKS, worker_args=args) as suite:
        yield suite


@pytest.fixture(scope="module")
def disk(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinySuite]:
    workdir = tmp_path_factory.mktemp("disk")
    args = ("--kv-host-bytes", "0", "--kv-disk-dir", str(workdir / "kv"), "--kv-disk-bytes", "4MiB")
    with tiny_suite(workdir, tiny_model_dir, NUM_KV_BLOCKS, worker_args=args) as suite:
        yield suite


def test_an_evicted_prefix_comes_back_from_the_host_tier(
    host: TinySuite, tiny_model_dir: Path
) -> None:
    first = _ask(host, PREFIX)
    assert first.usage.cached_tokens == 0
    _evict(host)
    again = _ask(host, PREFIX)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens == _full_blocks(tiny_model_dir)
    (stats,) = _stats(host).workers
    assert (stats.kv_host_bytes, stats.kv_disk_bytes) == (1 << 20, 0)
    assert stats.num_tier_reloads >= _full_blocks(tiny_model_dir) // BLOCK_SIZE
    assert stats.num_host_tier_blocks > 0 and stats.num_failed_reloads == 0


def test_an_evicted_prefix_comes_back_from_the_disk_tier(
    disk: TinySuite, tiny_model_dir: Path
) -> None:
    first = _ask(disk, PREFIX)
    assert first.usage.cached_tokens == 0
    _evict(disk)
    assert len(list((disk.suite.workdir / "kv").glob("*.kv"))) >= _full_blocks(tiny_model_dir) // 8
    again = _ask(disk, PREFIX)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens == _full_blocks(tiny_model_dir)
    (stats,) = _stats(disk).workers
    assert (stats.kv_host_bytes, stats.kv_disk_bytes) == (0, 4 << 20)
    assert stats.num_disk_tier_blocks > 0 and stats.num_host_tier_blocks == 0


def _stats(suite: TinySuite) -> scheduler_pb2.GetStatsResponse:
    reply: scheduler_pb2.GetStatsResponse = suite.scheduler_stub.GetStats(
        scheduler_pb2.GetStatsRequest(), timeout=5
    )
    return reply


def _ready_workers(suite: TinySuite) -> int:
    return len([w for w in _stats(suite).workers if w.is_ready])


def test_a_worker_sigkilled_and_restarted_answers_the_prefix_from_disk(
    disk: TinySuite, tiny_model_dir: Path
) -> None:
    prompt = PREFIX + "restart "
    first = _ask(disk, prompt)
    _evict(disk)  # the prefix's blocks are on disk now
    killed = disk.worker
    killed.process.send_signal(signal.SIGKILL)
    assert killed.process.wait(30) == -signal.SIGKILL
    disk.suite.services.remove(killed)  # its exit code is this test's doing
    deadline = time.monotonic() + 30
    while _ready_workers(disk):
        assert time.monotonic() < deadline, "the scheduler never noticed the worker died"
        time.sleep(0.1)
    disk.worker = disk.suite.restart(disk.worker)
    while not _ready_workers(disk):
        assert time.monotonic() < deadline + 60, "the restarted worker never became ready"
        time.sleep(0.1)
    again = _ask(disk, prompt)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens >= _full_blocks(tiny_model_dir)


def test_a_flipped_byte_in_a_disk_block_is_refused_and_the_prefix_recomputed(
    disk: TinySuite,
) -> None:
    prompt = "A flipped byte must never be served as a cached block of a prefix. " * 2
    first = _ask(disk, prompt)
    _evict(disk)
    files = sorted((disk.suite.workdir / "kv").glob("*.kv"))
    for path in files:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    again = _ask(disk, prompt)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens == 0
    assert "kv disk block refused" in disk.worker.log()
    (stats,) = _stats(disk).workers
    assert stats.num_failed_reloads > 0


def test_a_restarted_scheduler_learns_the_host_tier_and_answers_from_it(
    host: TinySuite, tiny_model_dir: Path
) -> None:
    prompt = PREFIX + "after a scheduler restart "
    ids = reference.tokenizer(tiny_model_dir)(prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    first = _ask(host, prompt)
    _evict(host)  # the prompt's blocks are in the worker's host tier now
    killed = host.scheduler
    killed.process.send_signal(signal.SIGKILL)
    assert killed.process.wait(30) == -signal.SIGKILL
    host.suite.services.remove(killed)  # its exit code is this test's doing
    host.scheduler = host.suite.restart(killed, wait_ready=False)
    wait_serving(host.scheduler.address, "canteen.v1.Scheduler", 60)
    (stats,) = _stats(host).workers  # learned from the worker's GetInfo, pool still empty
    assert stats.num_host_tier_blocks >= (len(ids) - 1) // BLOCK_SIZE
    again = _ask(host, prompt)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens == (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
