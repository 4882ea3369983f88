"""Prometheus metrics of the four services, scraped while a real request runs."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from canteen.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import BLOCK_SIZE, NUM_KV_BLOCKS, TinySuite
from tests.support.metrics import Samples, scrape, scrape_text, value

MODEL = {"model": "tiny", "version": "v1"}
MAX_TOKENS = 600  # long enough that the scrape after the first token lands mid-stream


def _gateway(suite: TinySuite) -> Samples:
    return scrape(suite.gateway.http_url + "/metrics")


def _scheduler(suite: TinySuite) -> Samples:
    return scrape(suite.scheduler.metrics_url)


def _blocks(samples: Samples, state: str) -> float:
    return value(samples, "canteen_kv_blocks", state=state, **MODEL)


def test_metrics_follow_one_request_and_fall_back(suite: TinySuite) -> None:
    gw0, s0 = _gateway(suite), _scheduler(suite)
    request = inference_pb2.GenerateRequest(
        prompt="metrics follow me", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    stream = suite.inference.Generate(request, metadata=(("x-request-id", "metrics-probe-1"),))
    messages = [next(stream)]
    gw1, s1 = _gateway(suite), _scheduler(suite)
    messages.extend(stream)
    gw2, s2 = _gateway(suite), _scheduler(suite)
    usage = messages[-1].usage
    assert usage.completion_tokens == MAX_TOKENS

    # Mid-stream: one running sequence holding the blocks of what it has so far.
    assert value(s1, "canteen_running_requests", **MODEL) == 1
    assert value(s1, "canteen_batch_size", **MODEL) == 1
    assert _blocks(s1, "used") >= _blocks(s0, "used") + -(-usage.prompt_tokens // BLOCK_SIZE)
    assert value(gw1, "canteen_gateway_in_flight_requests") == 1
    # The scheduler observes the queue time at the first token, not when the request ends
    # (its tokens ride the gateway's shared stream, its own call only ends it).
    assert value(s1, "canteen_queue_time_seconds_count", **MODEL) == (
        value(s0, "canteen_queue_time_seconds_count", **MODEL) + 1
    )
    assert value(gw1, "canteen_time_to_first_token_seconds_count", **MODEL) == value(
        gw0, "canteen_time_to_first_token_seconds_count", **MODEL
    ) + (1 if messages[0].token_ids else 0)

    # Afterwards: every block back, one observation per request, tokens counted exactly.
    assert value(s2, "canteen_running_requests", **MODEL) == 0
    assert _blocks(s2, "used") == _blocks(s0, "used")
    assert sum(_blocks(s2, st) for st in ("used", "cached", "free")) == NUM_KV_BLOCKS
    assert value(s2, "canteen_kv_blocks_capacity", **MODEL) == NUM_KV_BLOCKS
    assert value(gw2, "canteen_gateway_in_flight_requests") == 0

    def grew(name: str, before: Samples, after: Samples, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for name in (
        "canteen_time_to_first_token_seconds_count",
        "canteen_e2e_request_latency_seconds_count",
        "canteen_time_per_output_token_seconds_count",
    ):
        assert grew(name, gw0, gw2, **MODEL) == 1, name
    token_messages = sum(1 for m in messages if m.token_ids)
    assert grew("canteen_inter_token_latency_seconds_count", gw0, gw2, **MODEL) == (
        token_messages - 1
    )
    assert grew("canteen_requests_total", gw0, gw2, status="OK", **MODEL) == 1
    assert grew("canteen_generation_tokens_total", gw0, gw2, **MODEL) == MAX_TOKENS
    assert grew("canteen_prompt_tokens_total", gw0, gw2, **MODEL) == usage.prompt_tokens
    assert grew("canteen_queue_time_seconds_count", s0, s2, **MODEL) == 1
    assert grew("canteen_scheduler_requests_total", s0, s2, finish="length", **MODEL) == 1
    assert grew("canteen_step_duration_seconds_count", s0, s2, kind="prefill", **MODEL) >= 1
    # One decode step per token after the first, unless another test's request shared it.
    assert grew("canteen_step_duration_seconds_count", s0, s2, kind="decode", **MODEL) >= (
        MAX_TOKENS - 1
    )
    ttft = grew("canteen_time_to_first_token_seconds_sum", gw0, gw2, **MODEL)
    e2e = grew("canteen_e2e_request_latency_seconds_sum", gw0, gw2, **MODEL)
    assert 0 < ttft < e2e


def test_refusals_are_counted_by_status_without_request_ids(suite: TinySuite) -> None:
    before = _gateway(suite)
    bad = inference_pb2.GenerateRequest(prompt="x", max_tokens=0)
    unknown = inference_pb2.GenerateRequest(prompt="x", model="no-such-model", max_tokens=2)
    for request, code in ((bad, grpc.StatusCode.INVALID_ARGUMENT), (unknown, "NOT_FOUND")):
        with pytest.raises(grpc.RpcError) as err:
            list(suite.inference.Generate(request, metadata=(("x-request-id", "secret-id-42"),)))
        assert err.value.code().name == getattr(code, "name", code)
    after = _gateway(suite)
    for status in ("INVALID_ARGUMENT", "NOT_FOUND"):
        grew = value(after, "canteen_requests_total", status=status) - value(
            before, "canteen_requests_total", status=status
        )
        assert grew == 1, status
    for text in (scrape_text(suite.gateway.http_url + "/metrics"), _scrapes(suite)):
        assert "secret-id-42" not in text and "metrics-probe-1" not in text
        assert "no-such-model" not in text


def _scrapes(suite: TinySuite) -> str:
    services = (suite.registry, suite.scheduler, suite.worker, suite.gateway)
    return "\n".join(scrape_text(s.metrics_url) for s in services)


def test_worker_and_registry_report_their_state(suite: TinySuite) -> None:
    with grpc.insecure_channel(suite.worker.address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    before = scrape(suite.worker.metrics_url)
    list(suite.inference.Generate(inference_pb2.GenerateRequest(prompt="hi", max_tokens=3)))
    worker = scrape(suite.worker.metrics_url)
    assert value(worker, "canteen_worker_kv_cache_bytes", **MODEL) == info.kv_cache_bytes
    assert value(worker, "canteen_worker_memory_budget_bytes", **MODEL) == (
        info.memory_budget_bytes
    )
    steps = value(worker, "canteen_worker_steps_total", **MODEL)
    assert steps >= value(before, "canteen_worker_steps_total", **MODEL) + 1
    assert value(worker, "canteen_worker_step_duration_seconds_count", **MODEL) == steps
    registry = scrape(suite.registry.metrics_url)
    assert value(registry, "canteen_registry_models") == 1
    assert value(registry, "canteen_registry_workers", **MODEL) == 1
    scheduler = _scheduler(suite)
    assert value(scheduler, "canteen_worker_ready", worker="worker", **MODEL) == 1


@pytest.mark.parametrize("service", ["registry", "scheduler", "worker", "gateway", "gateway-http"])
def test_promtool_accepts_every_exposition(suite: TinySuite, service: str) -> None:
    url = (
        suite.gateway.http_url + "/metrics"
        if service == "gateway-http"
        else getattr(suite, service).metrics_url
    )
    text = scrape_text(url)
    assert "canteen_" in text
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_worker_reports_each_steps_cpu_and_its_idle_time_before_decode_steps(
    suite: TinySuite,
) -> None:
    """Where the suite's time per token goes on the worker: each step's engine-thread CPU,
    and before each decode step that followed another the engine's idle time, split into
    waiting for the plan (the scheduler) and handing it to the engine."""
    before = scrape(suite.worker.metrics_url)
    request = inference_pb2.GenerateRequest(prompt="hi", max_tokens=8, ignore_eos=True)
    assert sum(len(r.token_ids) for r in suite.inference.Generate(request)) == 8
    worker = scrape(suite.worker.metrics_url)

    def grew(name: str, **labels: str) -> float:
        return value(worker, name, **MODEL, **labels) - value(before, name, **MODEL, **labels)

    steps = grew("canteen_worker_steps_total")
    assert steps >= 8
    assert grew("canteen_worker_step_cpu_seconds_count") == steps
    assert grew("canteen_worker_step_cpu_seconds_sum") > 0
    decode_after_decode = grew("canteen_worker_idle_seconds_count", cause="plan")
    assert decode_after_decode >= 6  # the first decode step follows the prefill
    assert grew("canteen_worker_idle_seconds_count", cause="handoff") == decode_after_decode
