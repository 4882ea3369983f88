"""Tenants: the prefix cache between API keys, priority ceilings, the admin pages."""

from __future__ import annotations

import base64

import grpc
import httpx
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.security.conftest import GATEWAY_ADMIN_KEY, KEY_A, KEY_B, KEY_OPS, SecureSuite


def _complete(
    address: str, key: str, prompt: str, priority: int = 0
) -> inference_pb2.CompleteResponse:
    with grpc.insecure_channel(address) as channel:
        done: inference_pb2.CompleteResponse = inference_pb2_grpc.InferenceStub(channel).Complete(
            inference_pb2.GenerateRequest(
                prompt=prompt, max_tokens=2, temperature=0, priority=priority, ignore_eos=True
            ),
            timeout=60,
            metadata=(("authorization", f"Bearer {key}"),),
        )
    return done


def _cached_tokens(address: str, key: str, prompt: str) -> int:
    return int(_complete(address, key, prompt).usage.cached_tokens)


def test_with_isolation_one_tenant_never_hits_another_tenants_cache(secure: SecureSuite) -> None:
    prompt = "a secret prompt that tenant A sent, long enough to fill several KV blocks " * 3
    assert _cached_tokens(secure.isolated.address, KEY_A, prompt) == 0
    assert _cached_tokens(secure.isolated.address, KEY_A, prompt) > 0  # A's own cache works
    assert _cached_tokens(secure.isolated.address, KEY_B, prompt) == 0  # B learns nothing


def test_a_shared_cache_tells_one_tenant_what_another_sent(secure: SecureSuite) -> None:
    # What the README states about the default: a shared cache is shared across keys.
    prompt = "another prompt from tenant A, on the gateway with the shared cache " * 3
    assert _cached_tokens(secure.shared.address, KEY_A, prompt) == 0
    assert _cached_tokens(secure.shared.address, KEY_B, prompt) > 0


def test_priority_is_capped_by_the_key(secure: SecureSuite) -> None:
    # At its ceiling a key's request runs to its end.
    assert (
        _complete(secure.shared.address, KEY_OPS, "urgent", priority=5).usage.completion_tokens == 2
    )
    for key, asked, ceiling in ((KEY_A, 1, 0), (KEY_OPS, 6, 5)):
        with pytest.raises(grpc.RpcError) as info:
            _complete(secure.shared.address, key, "urgent", priority=asked)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"priority={asked}: API key" in (info.value.details() or "")
        assert f"may ask for at most {ceiling}" in (info.value.details() or "")
    response = httpx.post(
        f"{secure.shared.http_url}/v1/completions",
        json={"model": "tiny", "prompt": "urgent", "max_tokens": 2, "priority": 3},
        headers={"authorization": f"Bearer {KEY_A}"},
        timeout=60,
    )
    assert response.status_code == 403, response.text
    assert "priority=3: API key" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/status", "/status.json", "/metrics"])
def test_admin_pages_need_an_admin_key(secure: SecureSuite, path: str) -> None:
    url = f"{secure.shared.http_url}{path}"
    for headers in ({}, {"authorization": f"Bearer {KEY_A}"}):  # a tenant's key is not enough
        response = httpx.get(url, headers=headers, timeout=30)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == 'Basic realm="canteen admin"'
        assert response.json()["error"]["code"] == "UNAUTHENTICATED"
    bearer = httpx.get(url, headers={"authorization": f"Bearer {GATEWAY_ADMIN_KEY}"}, timeout=30)
    assert bearer.status_code == 200
    basic = base64.b64encode(f"admin:{GATEWAY_ADMIN_KEY}".encode()).decode()
    browser = httpx.get(url, headers={"authorization": f"Basic {basic}"}, timeout=30)
    assert browser.status_code == 200
    if path == "/status.json":
        assert [w["model"] for w in browser.json()["workers"]] == ["tiny:v1"]
