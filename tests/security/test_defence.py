"""The scheduler re-checks what the gateway hands it, even from the gateway's certificate."""

from __future__ import annotations

import math

import grpc
import pytest

from canteen.tls import sync_channel
from canteen.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.security.conftest import SecureSuite


def _request(**overrides: object) -> scheduler_pb2.ScheduleRequest:
    sampling = common_pb2.SamplingParams(temperature=0, top_p=1)
    for name in ("temperature", "top_p", "top_k", "top_logprobs"):
        if name in overrides:
            setattr(sampling, name, overrides.pop(name))
    fields: dict[str, object] = {
        "request_id": "probe",
        "model": "tiny",
        "version": "v1",
        "prompt_token_ids": [5, 6, 7],
        "max_tokens": 2,
        **overrides,
    }
    return scheduler_pb2.ScheduleRequest(sampling=sampling, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"prompt_token_ids": [5, 10**6]},
            "prompt_token_ids: token id 1000000 is outside the model's vocabulary of",
        ),
        ({"prompt_token_ids": [5, -3]}, "token id -3 is outside the model's vocabulary"),
        ({"stop_token_ids": [1 << 30]}, "stop_token_ids: token id 1073741824 is outside"),
        ({"temperature": math.nan}, "temperature=nan: must be in [0, 2]"),
        ({"temperature": math.inf}, "temperature=inf: must be in [0, 2]"),
        ({"temperature": 7.0}, "temperature=7.0: must be in [0, 2]"),
        ({"top_p": math.nan}, "top_p=nan: must be in (0, 1]"),
        ({"top_k": -2}, "top_k=-2: must be in 0..1048576"),
        ({"top_logprobs": 99}, "top_logprobs=99: must be in 0..20"),
        ({"priority": 1 << 20}, "priority=1048576: must be in -1000..1000"),
    ],
)
def test_bad_values_sent_straight_to_the_scheduler_are_refused(
    secure: SecureSuite, fields: dict[str, object], message: str
) -> None:
    with sync_channel(secure.scheduler.address, secure.tls("gateway"), "scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(_request(**fields), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
        # Nothing reached the worker, and the scheduler still serves.
        good = list(stub.Generate(_request(), timeout=30))
        assert sum(len(m.token_ids) for m in good) == 2
    assert "sequence refused" not in secure.worker.log()
