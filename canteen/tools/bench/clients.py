"""Sends one benchmark request over gRPC or the OpenAI-compatible HTTP edge and times it.

Both clients fill a ``RequestRecord`` the runner made, so a request cancelled at the end
of a run still leaves its start time behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
import grpc

from canteen.tools.bench.records import RequestRecord, RequestSpec
from canteen.v1 import inference_pb2, inference_pb2_grpc

Transport = Literal["grpc", "http"]


@dataclass(frozen=True)
class Target:
    """Where the benchmark sends its requests."""

    protocol: Transport = "grpc"
    """``grpc`` (canteen.v1.Inference/Generate) or ``http`` (POST /v1/completions)."""
    address: str = "127.0.0.1:50051"
    """The gateway's gRPC address."""
    url: str = "http://127.0.0.1:50057"
    """The gateway's HTTP base URL (default: canteen up's, its base port + 6)."""
    api_key: str = ""
    """Sent as ``authorization: Bearer KEY`` when set."""
    model: str = ""
    """Model name or alias; empty means the default model."""
    timeout: float | None = None
    """Seconds one request may take; None means no limit."""

    def __post_init__(self) -> None:
        if self.protocol not in ("grpc", "http"):
            raise ValueError(f"protocol={self.protocol!r}: must be 'grpc' or 'http'")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout={self.timeout}: must be > 0")

    @property
    def endpoint(self) -> str:
        return self.address if self.protocol == "grpc" else self.url


class Client(Protocol):
    async def send(self, spec: RequestSpec, record: RequestRecord, t0: float) -> None: ...

    async def count_tokens(self, text: str) -> int: ...


class _Timer:
    """Marks token-bearing messages; fills ttft, itl and e2e."""

    def __init__(self, record: RequestRecord, t0: float) -> None:
        self.record = record
        self.start = time.perf_counter()
        self.last: float | None = None
        record.start = self.start - t0

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft = now - self.start
        else:
            self.record.itl.append(now - self.last)
        self.last = now

    def fail(self, code: str, detail: str) -> None:
        self.record.error, self.record.detail = code, detail[:200]

    def finish(self) -> None:
        if self.record.error is None:
            self.record.e2e = time.perf_counter() - self.start


class GrpcClient:
    def __init__(self, target: Target, channel: grpc.aio.Channel) -> None:
        self.target = target
        self.stub = inference_pb2_grpc.InferenceStub(channel)
        key = target.api_key
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    async def send(self, spec: RequestSpec, record: RequestRecord, t0: float) -> None:
        request = inference_pb2.GenerateRequest(
            model=self.target.model,
            prompt=spec.prompt,
            max_tokens=spec.max_tokens,
            ignore_eos=True,
        )
        timer = _Timer(record, t0)
        try:
            stream = self.stub.Generate(
                request, metadata=self.metadata, timeout=self.target.timeout
            )
            async for msg in stream:
                if msg.token_ids:
                    timer.token()
                if msg.HasField("usage"):
                    record.prompt_tokens = msg.usage.prompt_tokens
                    record.completion_tokens = msg.usage.completion_tokens
        except grpc.aio.AioRpcError as exc:
            timer.fail(exc.code().name, exc.details() or "")
        timer.finish()

    async def count_tokens(self, text: str) -> int:
        request = inference_pb2.TokenizeRequest(model=self.target.model, prompt=text)
        reply = await self.stub.Tokenize(request, metadata=self.metadata, timeout=30)
        return len(reply.token_ids)


class HttpClient:
    def __init__(self, target: Target, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.base = target.url.rstrip("/")
        key = target.api_key
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def send(self, spec: RequestSpec, record: RequestRecord, t0: float) -> None:
        body = {
            "model": self.target.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        timer = _Timer(record, t0)
        timeout = aiohttp.ClientTimeout(total=self.target.timeout)
        url = f"{self.base}/v1/completions"
        try:
            async with self.session.post(
                url, json=body, headers=self.headers, timeout=timeout
            ) as reply:
                if reply.status != 200:
                    timer.fail(f"HTTP {reply.status}", await reply.text())
                else:
                    await _read_events(reply, timer)
        except TimeoutError:
            timer.fail("TIMEOUT", f"no answer within {self.target.timeout} s")
        except aiohttp.ClientError as exc:
            timer.fail(type(exc).__name__, str(exc))
        timer.finish()

    async def count_tokens(self, text: str) -> int:
        body = {"model": self.target.model, "prompt": text}
        async with self.session.post(
            f"{self.base}/tokenize", json=body, headers=self.headers
        ) as reply:
            if reply.status != 200:
                raise RuntimeError(f"POST /tokenize: HTTP {reply.status}: {await reply.text()}")
            data = await reply.json()
        return int(data["count"])


async def _read_events(reply: aiohttp.ClientResponse, timer: _Timer) -> None:
    """Reads ``data: {...}`` lines up to ``data: [DONE]``."""
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        _apply_chunk(json.loads(data), timer)
    timer.fail("INCOMPLETE", "the stream ended without data: [DONE]")


def _apply_chunk(chunk: dict[str, Any], timer: _Timer) -> None:
    if "error" in chunk:
        error = chunk["error"]
        timer.fail(str(error.get("code") or "STREAM_ERROR"), str(error.get("message", "")))
        return
    for choice in chunk.get("choices") or ():
        # The closing chunk of a choice may carry no text; it is not a token.
        if choice.get("text") or choice.get("finish_reason") is None:
            timer.token()
    usage = chunk.get("usage")
    if usage:
        timer.record.prompt_tokens = int(usage["prompt_tokens"])
        timer.record.completion_tokens = int(usage["completion_tokens"])


@asynccontextmanager
async def open_client(target: Target) -> AsyncIterator[Client]:
    """One channel or one HTTP session for the whole run."""
    if target.protocol == "grpc":
        async with grpc.aio.insecure_channel(target.address) as channel:
            yield GrpcClient(target, channel)
        return
    # No connection cap: the load mode decides how many requests are in flight.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield HttpClient(target, session)
