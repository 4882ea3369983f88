"""The edge's limit table, schema caps, preparation pool and rate-limit true-up, without a
server: each refusal names the field or the rule and the limit."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from canteen.plan import Constraint, Sampling
from canteen.v1 import scheduler_pb2
from gateway.admission import Admission
from gateway.catalog import ModelVersion
from gateway.config import GatewayConfig
from gateway.errors import InvalidInputError
from gateway.http import user_label
from gateway.limits import NeverFitsError, RateLimiter
from gateway.metrics import GatewayMetrics
from gateway.prep_pool import PrepBusyError, PrepDeadlineError, PrepPool
from gateway.service import READY_CACHE_SECONDS, InferenceService
from gateway.tokenizers import Tokenizer
from gateway.tools import Function, ToolRequest
from gateway.validate import GenerateInput, check_shape
from tests.support.tiny_model import build_tokenizer

CHAT = [{"role": "user", "content": "hi"}]


def _tools(*parameters: dict[str, object], choice: str = "auto") -> ToolRequest:
    functions = tuple(Function(f"f{i}", "", p) for i, p in enumerate(parameters))
    return ToolRequest(functions, choice)


def _nested(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "object"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_one_tool_over_its_schema_cap_is_refused_naming_the_flag() -> None:
    limits = GatewayConfig(max_tool_schema_bytes=100)
    big = {"type": "object", "description": "x" * 200}
    inp = GenerateInput("r", messages=list(CHAT), tools=_tools({"type": "object"}, big))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError) as info:
        check_shape(inp, limits)
    assert str(info.value) == (
        "tools[1].function.parameters: 237 bytes of JSON; the limit is 100 "
        "(--max-tool-schema-bytes)"
    )
    assert info.value.param == "tools[1].function.parameters"


def test_all_schemas_together_over_the_total_cap_are_refused() -> None:
    limits = GatewayConfig(max_tool_schema_bytes=1024, max_schema_bytes=2048)
    one = {"type": "object", "description": "x" * 900}
    inp = GenerateInput("r", messages=list(CHAT), tools=_tools(one, one, one))  # type: ignore[arg-type]
    with pytest.raises(
        InvalidInputError,
        match=r"the request's schemas have 2\d{3} bytes of JSON; "
        r"the limit is 2048 \(--max-schema-bytes\)",
    ):
        check_shape(inp, limits)
    two = GenerateInput("r", messages=list(CHAT), tools=_tools(one, one))  # type: ignore[arg-type]
    check_shape(two, limits)  # two fit


def test_a_deeply_nested_schema_is_refused_in_tools_and_response_format() -> None:
    limits = GatewayConfig(max_schema_depth=8)
    inp = GenerateInput("r", messages=list(CHAT), tools=_tools(_nested(4)))  # type: ignore[arg-type]
    check_shape(inp, limits)  # 4 objects nest 7 levels with their properties maps
    deep = GenerateInput("r", messages=list(CHAT), tools=_tools(_nested(40)))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError) as info:
        check_shape(deep, limits)
    assert str(info.value) == (
        "tools[0].function.parameters: nests 9 levels deep; the limit is 8 (--max-schema-depth)"
    )
    constraint = Constraint("json_schema", text=json.dumps(_nested(40)))
    prompt = GenerateInput("r", prompt="hi", sampling=Sampling(constraint=constraint))
    with pytest.raises(InvalidInputError, match=r"response_format: nests 9 levels deep"):
        check_shape(prompt, limits)


def test_too_many_tools_name_the_flag() -> None:
    inp = GenerateInput("r", messages=list(CHAT), tools=_tools({}, {}, {}))  # type: ignore[arg-type]
    with pytest.raises(
        InvalidInputError, match=r"^tools has 3 entries; the limit is 2 \(--max-tools\)$"
    ):
        check_shape(inp, GatewayConfig(max_tools=2))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prep_threads", 0, "prep_threads=0: must be in 1..64"),
        ("prep_queue", -1, "prep_queue=-1: must be >= 0"),
        ("max_tools", 129, "max_tools=129: must be in 1..128"),
        ("max_body_bytes", 10, "max_body_bytes=10: must be >= 1024"),
    ],
)
def test_the_limit_table_keeps_its_bounds(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        GatewayConfig(**{field: value})  # type: ignore[arg-type]
    assert str(info.value) == message


def test_a_full_pool_refuses_and_a_slow_preparation_misses_its_deadline() -> None:
    async def main() -> None:
        pool = PrepPool(num_threads=1, queue=1, deadline=0.3)
        release = threading.Event()
        slow = [asyncio.ensure_future(pool.run("waiting", release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(PrepBusyError) as busy:
            await pool.run("third", lambda: 1)
        assert "1 threads busy and 1 waiting, the limit (--prep-queue 1)" in str(busy.value)
        for task in slow:
            with pytest.raises(PrepDeadlineError) as late:
                await task
            assert (
                str(late.value) == "waiting took longer than the limit of 0.3 s (--prep-deadline)"
            )
        assert pool.num_pending == 2  # the threads are still held: still counted
        release.set()
        await asyncio.sleep(0.1)
        assert pool.num_pending == 0
        assert await pool.run("quick", lambda: 41 + 1) == 42
        pool.close()

    asyncio.run(main())


def test_the_event_loop_runs_while_a_preparation_works() -> None:
    async def main() -> float:
        pool = PrepPool(num_threads=1, queue=0, deadline=5)
        worst, last = 0.0, time.monotonic()
        work = asyncio.ensure_future(pool.run("sleep", lambda: time.sleep(0.5)))
        while not work.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        pool.close()
        return worst

    assert asyncio.run(main()) < 0.2


def test_a_reservation_on_an_estimate_is_trued_up_to_the_real_count() -> None:
    now = [0.0]
    limiter = RateLimiter(rpm=0, tpm=1000, clock=lambda: now[0])
    reservation = limiter.reserve("k", 100)
    limiter.true_up(reservation, 700)
    assert reservation.num_tokens == 700
    with pytest.raises(Exception, match="rate limit: 1000 tokens per minute for key k"):
        limiter.reserve("k", 301)
    assert reservation.settle(200) == 500  # refunds what the real request did not use
    limiter.reserve("k", 800)
    other = limiter.reserve("j", 10)
    with pytest.raises(NeverFitsError, match="request needs 1001 tokens"):
        limiter.true_up(other, 1001)


def test_the_user_field_is_logged_as_a_short_hash() -> None:
    label = user_label("alice@example.com" * 1000)
    assert label.startswith("u-") and len(label) == 18
    assert label == user_label("alice@example.com" * 1000) != user_label("bob")


class _Catalog:
    def resolve(self, name: str) -> ModelVersion:
        return ModelVersion("tiny", "v1", "safetensors", "/nowhere", 8192)


class _Tokenizers:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    async def get(self, model: ModelVersion) -> Tokenizer:
        return self.tokenizer


class _CountingTokenizer(Tokenizer):
    def __init__(self) -> None:
        super().__init__(build_tokenizer())
        self.num_encoded = 0
        self.num_compiled = 0

    def encode(self, text: str) -> list[int]:
        self.num_encoded += 1
        return super().encode(text)

    def check_constraint(self, constraint: Constraint) -> Constraint:
        self.num_compiled += 1
        return super().check_constraint(constraint)


def _admission(config: GatewayConfig, tokenizer: Tokenizer) -> Admission:
    metrics = GatewayMetrics(CollectorRegistry())
    return Admission(config, _Catalog(), _Tokenizers(tokenizer), metrics)  # type: ignore[arg-type]


def test_n_choices_are_prepared_once_and_each_takes_its_reservation() -> None:
    tokenizer = _CountingTokenizer()
    admission = _admission(GatewayConfig(rate_limit_tpm=100_000), tokenizer)
    schema = Constraint("json_schema", text='{"type": "object"}')
    prompt = "Once upon a time " * 1000  # past the small-prompt size: prepared on the pool
    base = GenerateInput("r", prompt=prompt, max_tokens=8, sampling=Sampling(constraint=schema))
    inputs = [replace(base, request_id=f"r-{i}") for i in range(4)]
    admitted = asyncio.run(admission.admit_all(inputs))
    assert (tokenizer.num_encoded, tokenizer.num_compiled) == (1, 1)
    num_ids = len(admitted[0].ids)
    assert [a.reservation.num_tokens for a in admitted] == [num_ids + 8] * 4
    assert [a.inp.request_id for a in admitted] == ["r-0", "r-1", "r-2", "r-3"]


def test_a_refused_preparation_gives_back_its_reservation() -> None:
    now = [0.0]
    admission = _admission(GatewayConfig(rate_limit_tpm=1000), _CountingTokenizer())
    admission.limiter = RateLimiter(0, 1000, clock=lambda: now[0])
    bad = Constraint("regex", text="(")
    inp = GenerateInput("r", prompt="hello", max_tokens=8, sampling=Sampling(constraint=bad))
    with pytest.raises(InvalidInputError, match=r"^regex: "):
        asyncio.run(admission.admit(inp))
    admission.limiter.reserve("anonymous", 1000)  # the whole minute is still there


class _Scheduler:
    """Answers GetStats with one ready worker of ``tiny``, counting the calls."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, timeout: float
    ) -> scheduler_pb2.GetStatsResponse:
        self.num_calls += 1
        stats = scheduler_pb2.GetStatsResponse()
        stats.workers.add(model="tiny", is_ready=True)
        return stats


def test_ready_models_ask_the_scheduler_at_most_once_a_second() -> None:
    scheduler = _Scheduler()
    metrics = GatewayMetrics(CollectorRegistry())
    tokenizers = _Tokenizers(_CountingTokenizer())
    service = InferenceService(
        GatewayConfig(),
        _Catalog(),  # type: ignore[arg-type]
        tokenizers,  # type: ignore[arg-type]
        scheduler,  # type: ignore[arg-type]
        metrics,
    )

    async def main() -> list[set[str]]:
        answers = [await service.ready_models() for _ in range(5)]
        await asyncio.sleep(READY_CACHE_SECONDS + 0.05)
        answers.append(await service.ready_models())
        return answers

    assert asyncio.run(main()) == [{"tiny"}] * 6
    assert scheduler.num_calls == 2
