"""A long prompt does not stall the stream beside it: with the shipped --max-step-stall, the
prompt is prefilled in chunks over several steps, each within the bound the scheduler planned,
and the decoding stream is in every one of them, its tokens exactly those it gets alone.

Steps, not time: the scheduler's DEBUG log says for every step the prefill bound it planned
("prefill bound") and what the worker computed ("step cost"), so the test reads the plan.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.conftest import BLOCK_SIZE
from tests.support.suite import Service, Suite, wait_serving

# Long enough that the prompt is prefilled while the stream runs even in 1-token chunks, as a
# loaded host's jittery steps can make them (the cost model sizes chunks from measured steps).
STREAM_TOKENS = 600
LONG_WORDS = "king queen Paris Rome time land far away capital tokens".split()


@pytest.fixture(scope="module")
def stalled(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    """The tiny suite with the scheduler's defaults (the stall bound on) and its DEBUG log;
    one step may compute 1,024 tokens, so without the bound the prompt would go in one."""
    suite = Suite(tmp_path_factory.mktemp("prefill"))
    try:
        registry = suite.start_registry(
            "--no-register-default",
            *("--add-model", f"tiny:v1={tiny_model_dir}", "--default-model", "tiny"),
        )
        suite.env = {"CANTEEN_LOG_LEVEL": "DEBUG"}
        scheduler = suite.start_scheduler(registry)
        suite.env = {}
        suite.start_worker(
            registry,
            "tiny",
            *("--num-kv-blocks", "512", "--block-size", str(BLOCK_SIZE), "--threads", "1"),
            *("--max-batched-tokens", "1024", "--dtype", "float32"),
        )
        wait_serving(scheduler.address, "canteen.v1.Scheduler", 60)
        suite.start_gateway(registry, scheduler)
        yield suite
    finally:
        codes = suite.stop()
    assert set(codes.values()) == {0}, codes


def service(suite: Suite, name: str) -> Service:
    return next(s for s in suite.services if s.name == name)


async def stream_beside(address: str, long_prompt: str | None) -> tuple[list[int], int]:
    """The stream's tokens, and the long prompt's prompt tokens (0: none sent): the long
    prompt is sent once the stream has 10 tokens."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=STREAM_TOKENS,
            temperature=0,
            ignore_eos=True,
        )
        tokens: list[int] = []
        long_sent: asyncio.Future[int] | None = None
        async for message in stub.Generate(request, timeout=120):
            tokens.extend(message.token_ids)
            if long_prompt is not None and long_sent is None and len(tokens) >= 10:
                long_sent = asyncio.ensure_future(_long(stub, long_prompt))
        return tokens, await long_sent if long_sent is not None else 0


async def _long(stub: inference_pb2_grpc.InferenceStub, prompt: str) -> int:
    request = inference_pb2.GenerateRequest(model="tiny", prompt=prompt, max_tokens=2)
    last = None
    async for message in stub.Generate(request, timeout=120):
        last = message
    assert last is not None and last.finish_reason
    return int(last.usage.prompt_tokens)


def steps_logged(
    log: str,
) -> tuple[dict[int, int], dict[int, int], dict[int, tuple[int, int]]]:
    """{step: planned prefill bound}, {step: the waiting prompt's position as planned (0: no
    prompt waiting, or its first chunk)}, {step: (tokens computed, sequences)} from the log."""
    bounds: dict[int, int] = {}
    positions: dict[int, int] = {}
    costs: dict[int, tuple[int, int]] = {}
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("msg") == "prefill bound":
            bounds[event["step_id"]] = event["bound"]
            positions[event["step_id"]] = event["position"]
        elif event.get("msg") == "step cost":
            costs[event["step_id"]] = (event["num_tokens"], event["num_sequences"])
    return bounds, positions, costs


def test_a_long_prompt_is_prefilled_in_bounded_chunks_beside_a_stream(stalled: Suite) -> None:
    gateway = service(stalled, "gateway")
    alone, _ = asyncio.run(stream_beside(gateway.address, None))
    long_prompt = " ".join(LONG_WORDS[(i * 3) % len(LONG_WORDS)] for i in range(400))
    beside, num_long = asyncio.run(stream_beside(gateway.address, long_prompt))
    assert len(alone) == STREAM_TOKENS
    assert beside == alone  # every token, the same ones, while the prompt was prefilled
    assert num_long >= 400
    bounds, positions, costs = steps_logged(service(stalled, "scheduler").log())
    # steps that carried a chunk of the long prompt next to the stream's decode: both
    # sequences in the step, and the prompt's first chunk or one planned at a later position
    # (after its prefill, the long request's own decode steps are planned at position 0)
    pairs = sorted(i for i, (_, seqs) in costs.items() if seqs == 2)
    chunks = [i for i in pairs if i == pairs[0] or positions.get(i, 0) > 0]
    assert sum(costs[i][0] - 1 for i in chunks) >= num_long // 2
    assert len(chunks) >= 3, {i: costs[i] for i in chunks}  # not in one step
    for i in chunks:
        assert costs[i][0] <= 1 + bounds[i], (i, costs[i], bounds[i])
    # the stream was in every step from the prompt's first chunk to its last
    assert all(costs[i][1] == 2 for i in range(chunks[0], chunks[-1] + 1) if i in costs)
