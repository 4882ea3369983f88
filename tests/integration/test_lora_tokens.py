"""LoRA adapters through the whole suite (real registry, scheduler, worker and gateway
processes on loopback), token for token against transformers + peft in float32: each
adapter alone and three adapters mixed with the base in one batch; prefix-cache sharing only
within one adapter; hot add and delete while streams run; the refusal by a worker that
serves no adapters; requests and tokens counted per adapter."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from canteen.v1 import inference_pb2, inference_pb2_grpc, registry_pb2, registry_pb2_grpc
from tests.support import reference
from tests.support.metrics import scrape, value
from tests.support.suite import (
    ADMIN_KEY,
    TRANSFORMERS_DTYPE,
    Service,
    Suite,
    canteen_models,
)
from tests.support.tiny_model import build_tiny_adapter, build_tiny_model

WORKER = ("--num-kv-blocks", "96", "--block-size", "8", "--threads", "1", *TRANSFORMERS_DTYPE)
# name -> the seed of its random weights; "late" is registered only while streams run
ADAPTERS = {"sql-writer": 1, "poet": 2, "chatty": 3, "late": 7}
PROMPT = "Once upon a time, in a land far away, there lived a king and a queen."


class Stack:
    def __init__(
        self, suite: Suite, registry: Service, scheduler: Service, gateway: Service, root: Path
    ) -> None:
        self.suite, self.registry, self.scheduler, self.gateway = (
            suite,
            registry,
            scheduler,
            gateway,
        )
        self.root = root
        self.channel = grpc.insecure_channel(gateway.address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)

    def add(self, name: str, base: str = "tiny:v1") -> None:
        done = canteen_models(self.registry, "add", f"{name}:v1={self.root / name}", "--base", base)
        assert done.returncode == 0, done.stderr

    def generate(
        self, model: str, prompt: str = PROMPT, max_tokens: int = 12
    ) -> list[inference_pb2.GenerateResponse]:
        request = inference_pb2.GenerateRequest(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        return list(self.inference.Generate(request, timeout=120))

    def listed(self) -> set[str]:
        listing = self.inference.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
        return {m.name for m in listing.models}


def _ids(messages: list[inference_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("lora-tokens")
    for name, seed in ADAPTERS.items():
        build_tiny_adapter(tiny_model_dir, root / name, seed=seed)
    plain = build_tiny_model(root / "plain", seed=5)
    build_tiny_adapter(plain, root / "plain-sql", seed=6)
    s = Suite(tmp_path_factory.mktemp("lora-tokens-suite"))
    try:
        registry = s.start_tiny_registry(tiny_model_dir)
        added = canteen_models(registry, "add", f"plain:v1={plain}")
        assert added.returncode == 0, added.stderr
        scheduler = s.start_scheduler(registry)
        s.start_worker(registry, "tiny:v1", *WORKER, "--max-loras", "4", name="lora-worker")
        s.start_worker(registry, "plain:v1", *WORKER, "--max-loras", "0", name="plain-worker")
        gateway = s.start_gateway(registry, scheduler)
        stack = Stack(s, registry, scheduler, gateway, root)
        stack.add("sql-writer")
        stack.add("poet")
        stack.add("plain-sql", base="plain:v1")
        _until(lambda: {"sql-writer", "poet", "plain-sql"} <= stack.listed(), "the adapters")
        yield stack
    finally:
        s.stop()


@functools.cache
def _peft(base: str, adapter: str | None) -> object:
    model: Any = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def expected(base: Path, adapter: Path | None, prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens of transformers + peft (peft's own LoRA layers, unmerged), float32;
    ``adapter`` None: the base model alone."""
    tok = reference.tokenizer(base)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    model = _peft(str(base), None if adapter is None else str(adapter))
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            input_ids=torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, len(ids) :].tolist())


def test_each_adapter_alone_gives_the_tokens_of_transformers_and_peft(
    stack: Stack, tiny_model_dir: Path
) -> None:
    got = {name: _ids(stack.generate(name)) for name in ("sql-writer", "poet")}
    want = {name: expected(tiny_model_dir, stack.root / name, PROMPT, 12) for name in got}
    assert got == want
    base = expected(tiny_model_dir, None, PROMPT, 12)
    assert len({tuple(base), *(tuple(t) for t in got.values())}) == 3  # each one differs
    last = stack.generate("sql-writer:v1", max_tokens=2)[-1]
    assert last.model == "sql-writer:v1"


def test_three_adapters_and_the_base_mixed_in_one_batch_are_token_exact(
    stack: Stack, tiny_model_dir: Path
) -> None:
    stack.add("chatty")
    _until(lambda: "chatty" in stack.listed(), "chatty listed")
    models = ["sql-writer", "poet", "chatty", "tiny"] * 2
    prompts = [f"{PROMPT} {i}" for i in range(len(models))]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        got = list(
            pool.map(lambda m, p: _ids(stack.generate(m, p, max_tokens=24)), models, prompts)
        )
    for model, prompt, tokens in zip(models, prompts, got, strict=True):
        adapter = None if model == "tiny" else stack.root / model
        assert tokens == expected(tiny_model_dir, adapter, prompt, 24), model


def test_two_adapters_never_share_prefix_cache_blocks_and_one_adapter_does(stack: Stack) -> None:
    # several full blocks, and no prefix of a prompt the other tests sent
    prompt = "Canteen batches requests on the fly and streams tokens back one by one. " * 2

    def cached(model: str) -> int:
        return stack.generate(model, prompt, max_tokens=2)[-1].usage.cached_tokens

    first = cached("sql-writer")
    again, other, base = cached("sql-writer"), cached("poet"), cached("tiny")
    assert first == 0 and other == 0 and base == 0
    assert again > 0 and again % 8 == 0  # whole blocks of its own earlier run


def test_the_openai_client_names_an_adapter_like_any_model(
    stack: Stack, tiny_model_dir: Path
) -> None:
    client = openai.OpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key="x", max_retries=0)
    reply = client.completions.create(
        model="poet:v1",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=1,  # each token's text comes from the base's tokenizer, found by the adapter
        extra_body={"ignore_eos": True},
    )
    tok = reference.tokenizer(tiny_model_dir)
    want = expected(tiny_model_dir, stack.root / "poet", PROMPT, 10)
    assert reply.choices[0].text == tok.decode(want, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert reply.model == "poet:v1"
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == [
        tok.decode([t], skip_special_tokens=False)  # type: ignore[attr-defined]
        for t in want
    ]
    models = {m.id: getattr(m, "parent", None) for m in client.models.list()}
    assert models["poet"] == "tiny" and models["tiny"] is None


class _Streaming(threading.Thread):
    """One greedy Generate of ``model``, its tokens kept as they arrive."""

    def __init__(self, stack: Stack, model: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.stack, self.model, self.prompt, self.max_tokens = stack, model, prompt, max_tokens
        self.tokens: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        request = inference_pb2.GenerateRequest(
            model=self.model,
            prompt=self.prompt,
            max_tokens=self.max_tokens,
            temperature=0,
            ignore_eos=True,
        )
        try:
            for message in self.stack.inference.Generate(request, timeout=120):
                self.tokens.extend(message.token_ids)
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_hot_add_and_delete_while_streams_run_lose_nothing(
    stack: Stack, tiny_model_dir: Path
) -> None:
    streams = [_Streaming(stack, "chatty", f"{PROMPT} stream {i}", 200) for i in range(4)]
    for stream in streams:
        stream.start()
    _until(lambda: all(s.tokens for s in streams), "every stream's first token")
    with grpc.insecure_channel(stack.registry.address) as channel:
        registry = registry_pb2_grpc.RegistryStub(channel)
        admin = (("authorization", f"Bearer {ADMIN_KEY}"),)
        registry.DeleteModel(
            registry_pb2.DeleteModelRequest(name="chatty", version="v1"), metadata=admin
        )
        _until(lambda: "chatty" not in stack.listed(), "chatty delisted")
        with pytest.raises(grpc.RpcError) as caught:
            stack.generate("chatty")
        late = registry_pb2.ModelRecord(
            name="late", version="v1", path=str(stack.root / "late"), base="tiny:v1"
        )
        registry.AddModel(registry_pb2.AddModelRequest(model=late), metadata=admin)
    assert any(s.is_alive() for s in streams), "the streams ended before the delete"
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'chatty' is not registered" in (caught.value.details() or "")
    _until(lambda: "late" in stack.listed(), "late listed")
    assert _ids(stack.generate("late")) == expected(tiny_model_dir, stack.root / "late", PROMPT, 12)
    for stream in streams:
        stream.join(120)
        assert stream.error is None
        assert stream.tokens == expected(tiny_model_dir, stack.root / "chatty", stream.prompt, 200)


def test_an_adapter_on_a_worker_without_adapters_is_refused_naming_it(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stack.generate("plain-sql")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == (
        "adapter='plain-sql:v1': no ready worker of model 'plain:v1' serves LoRA adapters "
        "(its workers run with --max-loras 0)"
    )
    client = openai.OpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="plain-sql", prompt="hi", max_tokens=2)
    assert "adapter='plain-sql:v1'" in refused.value.message


def test_requests_and_tokens_are_counted_per_adapter(stack: Stack) -> None:
    before = scrape(stack.gateway.metrics_url)
    label = {"adapter": "sql-writer:v1"}
    ok = value(before, "canteen_adapter_requests_total", status="OK", **label)
    generated = value(before, "canteen_adapter_tokens_total", kind="generation", **label)
    stack.generate("sql-writer", max_tokens=5)
    after = scrape(stack.gateway.metrics_url)
    assert value(after, "canteen_adapter_requests_total", status="OK", **label) == ok + 1
    assert value(after, "canteen_adapter_tokens_total", kind="generation", **label) == (
        generated + 5
    )

    def generated_there() -> float:
        scheduler = scrape(stack.scheduler.metrics_url)
        return value(
            scheduler, "canteen_scheduler_adapter_tokens_total", kind="generation", **label
        )

    # every sql-writer request so far ended in the scheduler too (just after its last token)
    _until(lambda: generated_there() == generated + 5, "the scheduler's count")
