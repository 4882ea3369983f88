"""LoRA adapters through the real registry, scheduler, worker and gateway processes, where
the worker applies no adapter: registration with ``canteen models add ... --base``, the
refusal of an adapter of another base, hot listing (no restart) with the base as parent,
per-key model lists, and a base that cannot be deleted while adapters name it.
tests/integration/test_lora_tokens.py runs adapters through the worker, token-exact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from canteen.models import adapter_sha256
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import TRANSFORMERS_DTYPE, Service, Suite, canteen_models
from tests.support.tiny_model import build_tiny_adapter, build_tiny_model

KEYS = "open-key\nsql-key models=sql-writer\nbase-key models=tiny\n"


class Stack:
    def __init__(self, suite: Suite, registry: Service, gateway: Service, paths: dict[str, Path]):
        self.suite, self.registry, self.gateway, self.paths = suite, registry, gateway, paths

    def models(self, key: str = "open-key") -> dict[str, object]:
        reply = httpx.get(
            f"{self.gateway.http_url}/v1/models", headers={"authorization": f"Bearer {key}"}
        )
        assert reply.status_code == 200, reply.text
        return {m["id"]: m.get("parent") for m in reply.json()["data"]}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("lora-models")
    other = build_tiny_model(root / "other", seed=3, hidden_size=32, intermediate_size=64)
    paths = {
        "sql": build_tiny_adapter(tiny_model_dir, root / "sql", seed=1),
        "sql-v2": build_tiny_adapter(tiny_model_dir, root / "sql-v2", seed=2),
        "foreign": build_tiny_adapter(other, root / "foreign", seed=4),
    }
    keys = root / "keys.txt"
    keys.write_text(KEYS)
    s = Suite(tmp_path_factory.mktemp("lora-suite"))
    try:
        registry = s.start_tiny_registry(tiny_model_dir)
        scheduler = s.start_scheduler(registry)
        worker_args = ("--num-kv-blocks", "64", "--block-size", "8", *TRANSFORMERS_DTYPE)
        s.start_worker(registry, "tiny:v1", *worker_args)
        gateway = s.start_gateway(registry, scheduler, "--api-keys-file", str(keys))
        yield Stack(s, registry, gateway, paths)
    finally:
        s.stop()


def _cli(stack: Stack, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout, and the last stderr line (after the --insecure warning)."""
    done = canteen_models(stack.registry, *args)
    lines = done.stderr.splitlines()
    return done.returncode, done.stdout, f"{lines[-1]}\n" if lines else ""


def _until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_adapter_registered_while_the_suite_runs_is_listed_with_its_parent(
    stack: Stack,
) -> None:
    assert "sql-writer" not in stack.models()
    sql = stack.paths["sql"]
    code, out, err = _cli(stack, "add", f"sql-writer:v1={sql}", "--base", "tiny:v1")
    assert code == 0, err
    assert out == f"added sql-writer:v1 (LoRA adapter of tiny:v1) sha256={adapter_sha256(sql)}\n"
    _until(lambda: "sql-writer" in stack.models())
    assert stack.models() == {"tiny": None, "sql-writer": "tiny"}
    code, out, _ = _cli(stack, "list")
    assert f"  sql-writer:v1  max_model_len=1024  base=tiny:v1  {sql.resolve()}\n" in out
    with grpc.insecure_channel(stack.gateway.address) as channel:
        listing = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(),
            metadata=(("authorization", "Bearer open-key"),),
        )
    assert [(m.name, m.version, m.parent, m.is_ready) for m in listing.models] == [
        ("sql-writer", "v1", "tiny", True),
        ("tiny", "v1", "", True),
    ]


def test_an_adapter_of_another_base_is_refused_at_registration(stack: Stack) -> None:
    foreign = stack.paths["foreign"]
    code, _, err = _cli(stack, "add", f"poet:v1={foreign}", "--base", "tiny:v1")
    assert code == 1
    assert err == (
        f"error: INVALID_ARGUMENT: path={str(foreign)!r}: adapter tensor "
        "'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight': shape [4, 64], but "
        "down_proj of base tiny:v1 has in_features 128; the adapter was made for another "
        "base\n"
    )
    code, _, err = _cli(stack, "add", f"poet:v1={stack.paths['sql']}")
    assert code == 1
    assert err == (
        "error: INVALID_ARGUMENT: base='': poet:v1 is a LoRA adapter (adapter_config.json); "
        "name its base model as NAME:VERSION (canteen models add ... --base)\n"
    )
    assert "poet" not in stack.models()


def test_per_key_model_lists_cover_adapters(stack: Stack) -> None:
    _until(lambda: "sql-writer" in stack.models())
    assert stack.models("sql-key") == {"sql-writer": "tiny"}
    assert stack.models("base-key") == {"tiny": None}
    client = openai.OpenAI(
        base_url=f"{stack.gateway.http_url}/v1", api_key="base-key", max_retries=0
    )
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.completions.create(model="sql-writer", prompt="hi", max_tokens=2)
    assert "sql-writer" in caught.value.message


def test_a_base_is_not_deleted_while_an_adapter_names_it(stack: Stack) -> None:
    _until(lambda: "sql-writer" in stack.models())
    code, _, err = _cli(stack, "delete", "tiny:v1")
    assert code == 1
    assert err == (
        "error: FAILED_PRECONDITION: model tiny:v1 is the base of LoRA adapter sql-writer:v1; "
        "delete those adapters first\n"
    )
    assert "tiny" in stack.models()


def test_an_alias_splits_across_adapter_versions_and_a_deleted_one_leaves_the_list(
    stack: Stack,
) -> None:
    _until(lambda: "sql-writer" in stack.models())
    sql2 = stack.paths["sql-v2"]
    code, _, err = _cli(stack, "add", f"sql-writer:v2={sql2}", "--base", "tiny:v1")
    assert code == 0, err
    code, out, err = _cli(stack, "alias", "sql-writer", "--to", "v1=90,v2=10")
    assert (code, out) == (
        0,
        "alias sql-writer -> sql-writer:v1=90 (90.0%), sql-writer:v2=10 (10.0%)\n",
    ), err
    code, _, err = _cli(stack, "alias", "sql-writer", "--delete")
    assert code == 0, err
    for version in ("v2", "v1"):
        code, _, err = _cli(stack, "delete", f"sql-writer:{version}")
        assert code == 0, err
    _until(lambda: "sql-writer" not in stack.models())
    assert stack.models() == {"tiny": None}
