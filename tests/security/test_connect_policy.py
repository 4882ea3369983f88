"""Scheduler.Connect under mutual TLS: only the gateway may open it (a Connect stream
admits requests as messages, so it is as guarded as a Generate call), and the gateway's own
requests, which ride it, are served."""

from __future__ import annotations

import grpc
import pytest

from canteen.tls import sync_channel
from canteen.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2_grpc
from tests.security.conftest import KEY_A, SecureSuite


@pytest.mark.parametrize("role", ["client", "worker", "registry"])
def test_only_the_gateway_may_open_a_connect_stream(secure: SecureSuite, role: str) -> None:
    with sync_channel(secure.scheduler.address, secure.tls(role), "scheduler") as channel:
        feed = scheduler_pb2_grpc.SchedulerStub(channel).Connect(iter(()), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(feed)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == (
        f"Connect is open to gateway only; this caller's certificate is for {role!r}"
    )


def test_the_gateway_s_requests_ride_its_connect_stream(secure: SecureSuite) -> None:
    with grpc.insecure_channel(secure.shared.address) as channel:
        request = inference_pb2.GenerateRequest(
            prompt="mutual TLS", max_tokens=6, temperature=0, ignore_eos=True
        )
        messages = list(
            inference_pb2_grpc.InferenceStub(channel).Generate(
                request, timeout=60, metadata=(("authorization", f"Bearer {KEY_A}"),)
            )
        )
    assert sum(len(m.token_ids) for m in messages) == 6
    assert messages[-1].usage.completion_tokens == 6
    assert "shared token stream open" in secure.shared.log()
    assert "the scheduler has no Connect" not in secure.shared.log()
