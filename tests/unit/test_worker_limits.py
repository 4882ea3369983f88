"""The scheduler believes a worker's description only within the declared bounds."""

from __future__ import annotations

import pytest

from canteen.v1 import registry_pb2, worker_pb2
from scheduler.blocks import MAX_NUM_BLOCKS, BlockPool
from scheduler.link import WorkerDescription, describe
from scheduler.worker_limits import WORKER_INFO_BOUNDS, Bound, info_refusal

ENTRY = registry_pb2.WorkerEntry(worker_id="w1", address="127.0.0.1:1", model="m", version="v")


def _info(**changes: object) -> WorkerDescription:
    fields: dict[str, object] = {
        "worker_id": "w1",
        "model": "m",
        "version": "v",
        "num_blocks": 128,
        "block_size": 16,
        "max_model_len": 2048,
        "max_batched_tokens": 512,
        "vocab_size": 1000,
        "eos_token_ids": [2],
    }
    return describe(worker_pb2.WorkerInfo(**{**fields, **changes}), "127.0.0.1:1")  # type: ignore[arg-type]


def test_a_sane_description_is_believed() -> None:
    assert info_refusal(_info(), ENTRY) is None


@pytest.mark.parametrize("bound", WORKER_INFO_BOUNDS, ids=lambda b: b.field)
def test_every_number_out_of_its_bound_is_refused_by_name(bound: Bound) -> None:
    too_big = bound.high + 1
    assert info_refusal(_info(**{bound.field: too_big}), ENTRY) == (
        f"{bound.field}={too_big}: must be in {bound.low}..{bound.high}"
    )


def test_eos_ids_outside_the_vocabulary_and_a_mismatched_entry_are_refused() -> None:
    assert info_refusal(_info(eos_token_ids=[1000]), ENTRY) == (
        "eos_token_ids: 1000 is outside the vocabulary 0..999"
    )
    assert info_refusal(_info(model="other"), ENTRY) == (
        "model='other': the registry's directory lists this worker with model='m'"
    )


@pytest.mark.parametrize("path", ["run.sock", "/" + "s" * 107])
def test_a_run_socket_that_cannot_be_a_local_socket_is_refused(path: str) -> None:
    assert info_refusal(_info(run_socket=path), ENTRY) == (
        f"run_socket={path!r}: must be empty or an absolute path of at most 107 bytes"
    )
    assert info_refusal(_info(run_socket="/tmp/canteen-worker-x/run.sock"), ENTRY) is None


def test_the_block_pool_refuses_a_pool_past_its_bound() -> None:
    with pytest.raises(ValueError, match=f"num_blocks={2**31 - 1}: must be in 1..{MAX_NUM_BLOCKS}"):
        BlockPool(2**31 - 1, 16)
