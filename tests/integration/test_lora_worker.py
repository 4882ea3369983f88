"""A worker process reports its LoRA limits (GetInfo) and exposes its adapter metrics."""

from __future__ import annotations

import grpc

from canteen.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.conftest import TinySuite
from tests.support.metrics import scrape, value

MODEL = {"model": "tiny", "version": "v1"}


def test_worker_reports_its_lora_limits_and_metrics(suite: TinySuite) -> None:
    with grpc.insecure_channel(suite.worker.address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
    assert (info.max_loras, info.max_cpu_loras) == (4, 8)  # the flags' defaults
    worker = scrape(suite.worker.metrics_url)
    assert value(worker, "canteen_worker_lora_loads_total", **MODEL) == 0
    assert value(worker, "canteen_worker_lora_load_seconds_count", **MODEL) == 0
    for tier in ("memory", "step"):
        assert value(worker, "canteen_worker_lora_evictions_total", tier=tier, **MODEL) == 0
