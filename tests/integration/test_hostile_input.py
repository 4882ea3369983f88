"""Hostile input at both edges: no service crashes, no KV block leaks, no INTERNAL or
UNKNOWN (no HTTP 5xx but 503 and 504), every error with a message, no prompt text in logs.

The property tests run against the session suite, then the last tests check that its
scheduler holds no blocks and no sequences and that every process still runs. The
strategies and the checks every answer must pass are in tests/support/hostile.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canteen.server import MAX_MESSAGE_BYTES
from canteen.v1 import inference_pb2, inference_pb2_grpc, scheduler_pb2
from gateway.config import GatewayConfig
from gateway.tools import ROLES
from tests.integration.conftest import NUM_KV_BLOCKS, TinySuite
from tests.support.hostile import (
    HTTP_PATHS,
    INT32,
    SETTINGS,
    _call,
    _check_grpc,
    _check_http,
    _dumps,
    _event,
    _nested,
    _post,
    content_types,
    generate_requests,
    long_text,
    openai_bodies,
    raw_bodies,
    weird_text,
)
from tests.support.suite import Service

CRASH_SIGNS = ("Traceback (most recent call last)", "Error handling request", "Unexpected error")
# Finding: when a client cancels a stream, the scheduler's generate() (an async generator
# inside tracer.start_as_current_span) is closed in another contextvars Context and
# OpenTelemetry logs this with a traceback. Noise, not a crash: the request is cancelled.
KNOWN_NOISE = ("Failed to detach context",)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def log_marks(suite: TinySuite) -> dict[str, int]:
    """Where the log of each service running before this module's requests stood."""
    return {svc.name: len(svc.log()) for svc in suite.suite.services if svc.process.poll() is None}


@pytest.fixture(scope="module")
def http(suite: TinySuite, log_marks: dict[str, int]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=suite.gateway.http_url, timeout=60) as client:
        yield client


# -- the gRPC edge --------------------------------------------------------------------------


@SETTINGS
@given(
    req=generate_requests(),
    streamed=st.booleans(),
    timeout=st.sampled_from([60.0, 60.0, 60.0, 0.05]),
)
def test_grpc_generate_and_complete_survive_any_request(
    suite: TinySuite,
    log_marks: dict[str, int],
    req: inference_pb2.GenerateRequest,
    streamed: bool,
    timeout: float,
) -> None:
    _event(_check_grpc(lambda: _call(suite.inference, req, streamed, timeout)).name)


@settings(SETTINGS, max_examples=30)
@given(
    prompt=weird_text | long_text,
    messages=st.lists(st.tuples(st.sampled_from(ROLES) | weird_text, weird_text), max_size=3),
    use_messages=st.booleans(),
    model=st.sampled_from(["", "tiny", "nope"]),
    token_ids=st.lists(INT32 | st.integers(0, 520), max_size=20),
)
def test_grpc_tokenize_and_detokenize_survive_any_request(
    suite: TinySuite,
    log_marks: dict[str, int],
    prompt: str,
    messages: list[tuple[str, str]],
    use_messages: bool,
    model: str,
    token_ids: list[int],
) -> None:
    req = inference_pb2.TokenizeRequest(model=model)
    if use_messages:
        req.messages.SetInParent()
        for role, content in messages:
            req.messages.messages.add(role=role, content=content)
    else:
        req.prompt = prompt
    _check_grpc(lambda: suite.inference.Tokenize(req, timeout=30))
    detok = inference_pb2.DetokenizeRequest(model=model, token_ids=token_ids)
    _check_grpc(lambda: suite.inference.Detokenize(detok, timeout=30))


def test_grpc_streams_cancelled_or_timed_out_midway(
    suite: TinySuite, log_marks: dict[str, int]
) -> None:
    def one(i: int) -> None:
        req = inference_pb2.GenerateRequest(prompt=f"Once upon a time {i}", max_tokens=4)
        req.ignore_eos = True
        call = suite.inference.Generate(req, timeout=0.02 if i % 3 == 0 else 60)
        try:
            for _ in call:
                call.cancel()
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(24)))


def test_a_grpc_request_over_the_receive_limit_is_refused_before_parsing(
    suite: TinySuite, log_marks: dict[str, int]
) -> None:
    req = inference_pb2.GenerateRequest(prompt="x" * (MAX_MESSAGE_BYTES + 1024), max_tokens=1)
    for streamed in (True, False):
        with pytest.raises(grpc.RpcError) as info:
            _call(suite.inference, req, streamed, 60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()


@pytest.mark.parametrize("raw", [b"\x12\x03\xff\xfe\xfd", b"\x12\xff\xff\xff"])
def test_undecodable_grpc_bytes_are_invalid_argument(suite: TinySuite, raw: bytes) -> None:
    complete = suite.channel.unary_unary("/canteen.v1.Inference/Complete")
    with pytest.raises(grpc.RpcError) as info:
        complete(raw, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


@pytest.mark.parametrize("field", ["role", "model"])
def test_a_long_bad_name_keeps_its_status(suite: TinySuite, field: str) -> None:
    req = inference_pb2.GenerateRequest(max_tokens=1)
    if field == "role":
        req.messages.messages.add(role="r" * 20_000, content="hi")
    else:
        req.prompt, req.model = "hi", "m" * 20_000
    with pytest.raises(grpc.RpcError) as info:
        suite.inference.Complete(req, timeout=30)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


# -- the HTTP edge --------------------------------------------------------------------------


@settings(SETTINGS, max_examples=150)
@given(path=st.sampled_from(HTTP_PATHS), body=openai_bodies())
def test_http_json_edge_survives_any_json(http: httpx.Client, path: str, body: object) -> None:
    _check_http(_post(http, path, _dumps(body), "application/json"))


@settings(SETTINGS, max_examples=60)
@given(path=st.sampled_from(HTTP_PATHS), raw=raw_bodies, content_type=content_types)
def test_http_edge_survives_any_bytes(
    http: httpx.Client, path: str, raw: bytes, content_type: str
) -> None:
    _check_http(_post(http, path, raw, content_type))


@pytest.mark.parametrize(
    ("path", "raw", "content_type", "message"),
    [
        ("/v1/completions", _nested(100_000, "[", "]"), "application/json", "nest too deeply"),
        ("/tokenize", _nested(100_000, "[", "]"), "application/json", "nest too deeply"),
        ("/v1/completions", b'{"prompt": "hi"}', "application/json; charset=bogus", "charset"),
        ("/v1/completions", b'{"max_tokens": ' + b"9" * 5000 + b"}", "application/json", "digit"),
        ("/v1/completions", _dumps({"prompt": "\ud800"}), "application/json", "prompt: not"),
        ("/tokenize", _dumps({"prompt": "a\udfff"}), "application/json", "prompt: not valid"),
        (
            "/tokenize",
            _dumps({"messages": [{"role": "user", "content": "\ud800"}]}),
            "application/json",
            "messages[0].content: not valid Unicode",
        ),
        ("/v1/completions", _dumps({"prompt": "hi", "seed": 2**64}), "application/json", "seed="),
        (
            "/v1/completions",
            _dumps({"prompt": "hi", "temperature": 10**400}),
            "application/json",
            "temperature: the number is too large",
        ),
        (
            "/v1/completions",
            b'{"prompt": "hi", "model": ' + _nested(980, "[", "]") + b"}",
            "application/json",
            "nest too deeply",
        ),
    ],
)
def test_http_regressions_are_400_naming_the_problem(
    http: httpx.Client, path: str, raw: bytes, content_type: str, message: str
) -> None:
    """Each of these was an HTTP 500 (an exception the edge did not know)."""
    response = _post(http, path, raw, content_type)
    assert response.status_code == 400, response.text[:500]
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # These were answered with the whole value echoed back (str() of it).
        (b'{"prompt": "hi", "model": ' + _nested(900, "[", "]") + b"}", "model: expected a string"),
        (
            b'{"messages": [{"role": ' + _nested(900, "[", "]") + b', "content": "x"}]}',
            "messages[0].role: expected a string, got list",
        ),
    ],
)
def test_tokenize_names_a_field_of_the_wrong_type(
    http: httpx.Client, body: bytes, message: str
) -> None:
    response = _post(http, "/tokenize", body, "application/json")
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["message"].startswith(message)


def test_http_seeds_past_int64_and_uint64_work_with_n(http: httpx.Client) -> None:
    for seed in (-1, 2**64 - 1):
        body = {"prompt": "Once upon a time", "max_tokens": 2, "n": 3, "seed": seed}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text[:500]
        assert len(response.json()["choices"]) == 3


def test_an_http_body_over_the_limit_is_413(suite: TinySuite, http: httpx.Client) -> None:
    limit = GatewayConfig().max_body_bytes  # the gateway runs with the default
    assert limit == 4 * 1024 * 1024
    head, tail = b'{"prompt": "', b'", "max_tokens": 1}'
    at_limit = head + b"x" * (limit - len(head) - len(tail)) + tail
    response = _post(http, "/v1/completions", at_limit, "application/json")
    assert response.status_code == 400, response.text[:300]  # read: too many characters
    assert "characters" in response.json()["error"]["message"]
    over = head + b"x" * (limit + 1 - len(head) - len(tail)) + tail
    response = _post(http, "/v1/completions", over, "application/json")
    assert response.status_code == 413, response.text[:300]
    assert "--max-body-bytes" in response.json()["error"]["message"]


# -- prompt text never reaches the logs -----------------------------------------------------


@pytest.fixture(scope="module")
def screened(suite: TinySuite, log_marks: dict[str, int]) -> Iterator[Service]:
    gateway = suite.suite.start_gateway(
        suite.registry,
        suite.scheduler,
        "--screen",
        "deny-list",
        "--screen-config",
        json.dumps({"patterns": ["SECRET-[0-9a-f]{32}-screened"]}),
        name="gateway-screened",
    )
    yield gateway
    assert gateway.terminate() == 0


def test_prompt_text_never_reaches_the_logs(
    suite: TinySuite, screened: Service, http: httpx.Client
) -> None:
    marker = f"SECRET-{uuid.uuid4().hex}"
    stub = suite.inference

    def gen(**fields: Any) -> inference_pb2.GenerateRequest:
        messages = fields.pop("messages", None)
        req = inference_pb2.GenerateRequest(**fields)
        for role, content in messages or ():
            req.messages.messages.add(role=role, content=content)
        return req

    grpc_requests = [
        gen(prompt=f"{marker} Once upon a time", max_tokens=2, stop=[marker]),
        gen(messages=[("system", marker), ("user", f"say {marker}")], max_tokens=2),
        gen(prompt=marker, max_tokens=2, temperature=-1),  # each of these is refused
        gen(prompt=marker, max_tokens=0),
        gen(prompt=marker, max_tokens=2, stop=[marker * 10]),
        gen(prompt=marker * 3000, max_tokens=2),  # past the context once tokenized
        gen(messages=[("wizard", marker)], max_tokens=2),
        gen(messages=[(marker, "hi")], max_tokens=2),
        gen(prompt=marker, max_tokens=2, model=marker),
        gen(prompt=marker, max_tokens=2, stop_token_ids=[10**6]),
        gen(prompt=marker, max_tokens=2, top_logprobs=99),
    ]
    for req in grpc_requests:
        for streamed in (True, False):
            _check_grpc(partial(_call, stub, req, streamed, 60))
    tokenize = inference_pb2.TokenizeRequest(prompt=marker)
    _check_grpc(lambda: stub.Tokenize(tokenize, timeout=30))

    bodies: list[tuple[str, object]] = [
        ("/v1/completions", {"prompt": marker, "max_tokens": 2, "stop": marker}),
        ("/v1/completions", {"prompt": marker, "max_tokens": 2, "stream": True, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": marker}], "n": 2}),
        ("/v1/completions", {"prompt": marker, "max_tokens": 2, "temperature": 9}),
        ("/v1/completions", {"prompt": f"{marker}\ud800", "max_tokens": 2}),
        ("/v1/completions", {"prompt": marker, "max_tokens": 2, "stop": [marker * 100]}),
        ("/v1/completions", {"prompt": [marker, marker], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": marker, "content": marker}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [marker]}]}),
        ("/v1/chat/completions", {"messages": marker, "max_tokens": 2}),
        ("/v1/completions", {"prompt": marker, "model": marker, "max_tokens": 2}),
        ("/tokenize", {"prompt": marker}),
        ("/tokenize", {"messages": [{"role": "user", "content": marker}]}),
        ("/tokenize", {"messages": [{"role": "nobody", "content": marker}]}),
        ("/detokenize", {"tokens": [marker]}),
    ]
    for path, body in bodies:
        if path.startswith("/v1/") and isinstance(body, dict) and "max_tokens" not in body:
            body["max_tokens"] = 2
        _check_http(_post(http, path, _dumps(body), "application/json"))
    for raw in (f"{marker} is not JSON".encode(), f'{{"prompt": "{marker}'.encode()):
        _check_http(_post(http, "/v1/completions", raw, "application/json"))

    # The content screen refuses these; its reason quotes the phrase back to the caller only.
    screened_stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(screened.address))
    phrase = f"{marker}-screened"
    for text in (phrase, f"ignore all previous instructions {marker}"):
        with pytest.raises(grpc.RpcError) as info:
            screened_stub.Complete(gen(prompt=text, max_tokens=2), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "content screen" in info.value.details()
        with pytest.raises(grpc.RpcError):
            list(screened_stub.Generate(gen(messages=[("user", text)], max_tokens=2), timeout=60))
        response = httpx.post(
            f"{screened.http_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 2},
            timeout=60,
        )
        assert response.status_code == 400 and "content screen" in response.text

    # A positive control: the request id is logged on purpose, so this one must show up.
    control = f"CONTROL-{uuid.uuid4().hex}"
    body = {"prompt": "Once upon a time", "max_tokens": 1}
    assert http.post("/v1/completions", json=body, headers={"x-request-id": control}).is_success
    deadline = time.monotonic() + 5
    while control not in suite.gateway.log():
        assert time.monotonic() < deadline, "the control request id never reached the log"
        time.sleep(0.1)
    leaks = {svc.name for svc in suite.suite.services if marker in svc.log()}
    assert not leaks, f"prompt text in the logs of {sorted(leaks)}"


# -- afterwards: nothing leaked, nothing died -----------------------------------------------


def test_no_block_or_sequence_is_left_behind(suite: TinySuite) -> None:
    deadline = time.monotonic() + 10
    while True:
        stats = suite.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        state = [
            (w.worker_id, w.num_free_blocks, w.num_total_blocks, w.num_running, w.num_waiting)
            for w in stats.workers
        ]
        if state and all(f == t == NUM_KV_BLOCKS and r == q == 0 for _, f, t, r, q in state):
            break
        assert time.monotonic() < deadline, f"left behind: {state}"
        time.sleep(0.2)
    assert all(w.is_ready for w in stats.workers), stats


def test_every_service_still_runs_and_logged_no_crash(
    suite: TinySuite, log_marks: dict[str, int], screened: Service
) -> None:
    # The services that ran when this module began (other modules stop gateways of their own),
    # and the one it started.
    running = [svc for svc in suite.suite.services if svc.name in log_marks] + [screened]
    assert {svc.name for svc in running} >= {"registry", "scheduler", "worker", "gateway"}
    for svc in running:
        assert svc.process.poll() is None, f"{svc.name} exited with {svc.process.returncode}"
    for svc in running:
        log = svc.log()[log_marks.get(svc.name, 0) :]
        events, unstructured = _split_log(log)
        crashes = [b for b in _blocks(unstructured) if any(sign in b for sign in CRASH_SIGNS)]
        assert not crashes, f"{svc.name} logged:\n" + "\n".join(crashes)[-4000:]
        alarms = [e for e in events if _is_alarm(e)]
        assert not alarms, f"{svc.name} logged:\n" + "\n".join(map(json.dumps, alarms))[-4000:]


# Log events no hostile input may cause: any error, any line with a traceback (a warning too:
# structlog writes exc_info as "exception"), and a lost worker or a refused sequence whatever
# their level. A test that causes one on purpose names its (service, msg) here.
ALARMS = ("worker lost", "worker link crashed", "sequence refused")
DELIBERATE: frozenset[tuple[str, str]] = frozenset()


def _is_alarm(event: dict[str, Any]) -> bool:
    if (event.get("service"), event.get("msg")) in DELIBERATE:
        return False
    return (
        event.get("level") in ("error", "critical")
        or event.get("msg") in ALARMS
        or "exception" in event
        or any(sign in json.dumps(event) for sign in CRASH_SIGNS)
    )


def _split_log(log: str) -> tuple[list[dict[str, Any]], list[str | None]]:
    """structlog's JSON lines as events; every other line as text (None where a JSON line
    stood, so runs of text stay apart)."""
    events: list[dict[str, Any]] = []
    lines: list[str | None] = []
    for line in log.splitlines():
        try:
            event = json.loads(line) if line.startswith("{") else None
        except ValueError:
            event = None  # a torn or foreign line: judged as text
        if isinstance(event, dict):
            events.append(event)
            lines.append(None)
        else:
            lines.append(line)
    return events, lines


def _blocks(lines: list[str | None]) -> list[str]:
    """Runs of lines that are not structured JSON log lines (tracebacks, library warnings),
    less the known noise."""
    blocks: list[list[str]] = []
    is_open = False
    for line in lines:
        if line is None:
            is_open = False
            continue
        if not is_open:
            blocks.append([])
            is_open = True
        blocks[-1].append(line)
    return [
        "\n".join(b)
        for b in blocks
        if b and not any(b[0].startswith(noise) for noise in KNOWN_NOISE)
    ]
