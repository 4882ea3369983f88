"""``--quantization auto``, the default: a GGUF whose linears ship Q4_1 is served at int4 and
one whose linears ship Q8_0 at int8, their values as shipped (the tied Q8_0 head too); other
checkpoints keep their dtype. A greedy sequence of the 4-bit default gets the same tokens and
logprob bits alone and in a batch of 16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.support.mixes import Arrival, alone, run_mix
from tests.support.tiny_gguf import VOCAB, write_tiny_gguf
from worker.config import WorkerConfig
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.model.forward import FastModel
from worker.model.loader import choose_dtype, choose_quantization, load_model
from worker.model.quant import Int4Linear, Int8Linear

CPU = torch.device("cpu")
# auto picks low bits only where bfloat16 dot products are in hardware; the choice itself is
# tested on every CPU by saying which flags it sees.
BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})


@pytest.fixture(autouse=True, scope="module")
def _bf16_cpu() -> Iterator[None]:
    with mock.patch("worker.model.loader.cpu_flags", lambda: BF16_CPU):
        yield


def test_auto_keeps_the_dtype_default_on_a_cpu_without_avx512_bf16(q4_gguf: Path) -> None:
    with mock.patch("worker.model.loader.cpu_flags", lambda: frozenset({"avx2", "fma"})):
        assert choose_quantization("auto", str(q4_gguf), "gguf", CPU) == (
            "none",
            "--quantization auto: this CPU has no AVX512-BF16 (its default is faster)",
        )


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("q4") / "tiny.Q4_1.gguf")


def test_auto_is_the_default_and_takes_any_dtype() -> None:
    assert WorkerConfig().quantization == "auto"
    assert WorkerConfig(dtype="float32").quantization == "auto"  # auto then picks none
    with pytest.raises(ValueError, match=r"dtype.*must be auto or bfloat16 with --quantization"):
        WorkerConfig(dtype="float32", quantization="int4")


def test_auto_serves_q4_1_at_int4_and_q8_0_at_int8(q4_gguf: Path, tmp_path: Path) -> None:
    chosen, why = choose_quantization("auto", str(q4_gguf), "gguf", CPU)
    assert chosen == "int4"
    assert why == "--quantization auto: the GGUF's linears ship 14 Q4_1; int4 as shipped"
    q8 = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", GGMLQuantizationType.Q8_0)
    assert choose_quantization("auto", str(q8), "gguf", CPU) == (
        "int8",
        "--quantization auto: the GGUF's linears ship 14 Q8_0; int8 as shipped",
    )
    f32 = write_tiny_gguf(tmp_path / "tiny.F32.gguf", GGMLQuantizationType.F32)
    assert choose_quantization("auto", str(f32), "gguf", CPU) == (
        "none",
        "--quantization auto: the GGUF's linears ship 14 F32, not all Q4_1 or Q8_0",
    )


def test_auto_keeps_other_checkpoints_and_settings_in_their_dtype(q4_gguf: Path) -> None:
    path = str(q4_gguf)
    assert choose_quantization("auto", path, "safetensors", CPU) == (
        "none",
        "--quantization auto: a safetensors checkpoint runs in its own dtype",
    )
    assert choose_quantization("auto", path, "gguf", CPU, "float32") == (
        "none",
        "--quantization auto: --dtype float32 (the low-bit kernels compute in bfloat16)",
    )
    assert choose_quantization("auto", path, "gguf", torch.device("cuda")) == (
        "none",
        "--quantization auto: the low-bit kernels are CPU-only",
    )
    assert choose_quantization("int8", path, "gguf", CPU) == ("int8", "--quantization int8")


@pytest.fixture(scope="module")
def q4_runner(q4_gguf: Path) -> ModelRunner:
    quantization, _ = choose_quantization("auto", str(q4_gguf), "gguf", CPU)
    dtype, _ = choose_dtype("auto", CPU, quantization)
    loaded = load_model(str(q4_gguf), "gguf", "", CPU, dtype, False, quantization=quantization)
    return ModelRunner(loaded, RunnerConfig(2000, 8, max_batched_tokens=1024))


def test_every_linear_and_the_head_carry_the_files_blocks(q4_runner: ModelRunner) -> None:
    """Each layer's fused linears are 4-bit from the file's Q4_1 blocks and the head (tied to
    the Q8_0 embedding) is 8-bit from its Q8_0 blocks, all through Canteen's kernel."""
    model = q4_runner.loaded.forward
    assert isinstance(model, FastModel)
    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(linear, Int4Linear) and linear.packed is not None
    head = model.lm_head
    assert isinstance(head, Int8Linear) and head.q8 is not None and head.packed is not None
    embedding = model.embed  # the head is tied to it
    assert torch.equal(head.q8.dequantize().to(embedding.dtype), embedding)


def test_greedy_tokens_alone_equal_those_in_a_batch_of_16(q4_runner: ModelRunner) -> None:
    """16 prompts prefilled and decoded together, each against the same prompt alone: the
    same tokens and the same logprob bits (any change in a row's sums shows there first)."""
    mix = [
        Arrival(f"s{i}", tuple((7 * i + j * 13) % (VOCAB - 3) + 3 for j in range(5 + i)), 12, 1024)
        for i in range(16)
    ]
    together = run_mix(q4_runner, mix)
    for arrival in mix:
        assert together[arrival.seq_id] == alone(q4_runner, arrival), arrival.seq_id
    assert len({tuple(t for t, _ in together[a.seq_id]) for a in mix}) > 8, "too few differ"
