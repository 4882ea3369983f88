"""The gateway's inter-token latency histogram, filled a batch of gaps at a time: what
/metrics shows is what one observe per streamed message would have shown."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from canteen.metrics import TOKEN_BUCKETS
from gateway.metrics import ITL_FLUSH_GAPS, GatewayMetrics, observe_all

ITL = "canteen_inter_token_latency_seconds"


def _itl(registry: CollectorRegistry, suffix: str) -> float:
    value = registry.get_sample_value(f"{ITL}{suffix}", {"model": "m", "version": "v1"})
    return 0.0 if value is None else value


def test_gaps_batched_into_the_histogram_export_as_one_observe_each() -> None:
    rng = random.Random(7)
    gaps = [rng.expovariate(200) for _ in range(500)]
    gaps += [*TOKEN_BUCKETS[:-1], 0.0, 1e6]  # every bound exactly, and past the last one
    one, batched = CollectorRegistry(), CollectorRegistry()
    each = Histogram("h", "d", buckets=TOKEN_BUCKETS, registry=one)
    for gap in gaps:
        each.observe(gap)
    observe_all(Histogram("h", "d", buckets=TOKEN_BUCKETS, registry=batched), gaps)

    def buckets(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if "_created" not in line and "_sum" not in line]

    assert buckets(batched) == buckets(one)
    assert batched.get_sample_value("h_sum") == one.get_sample_value("h_sum")


def test_a_stream_s_gaps_are_counted_every_batch_and_at_its_end() -> None:
    registry = CollectorRegistry()
    timer = GatewayMetrics(registry).track("m", "v1", arrival=0.0)
    for _ in range(ITL_FLUSH_GAPS):  # the first message has no gap before it
        timer.tokens(1)
    assert _itl(registry, "_count") == 0
    timer.tokens(2)
    assert _itl(registry, "_count") == ITL_FLUSH_GAPS
    timer.tokens(1)
    timer.tokens(0)  # a message without tokens is no gap
    timer.finish("OK", prompt_tokens=5, cached_tokens=0)
    assert _itl(registry, "_count") == ITL_FLUSH_GAPS + 1
    assert timer.first is not None and timer.last is not None
    assert abs(_itl(registry, "_sum") - (timer.last - timer.first)) < 1e-9
    assert timer.num_tokens == ITL_FLUSH_GAPS + 3
