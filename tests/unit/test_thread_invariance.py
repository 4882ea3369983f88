"""A row's bits do not depend on how many torch threads computed it.

The worker runs narrow steps on one thread and wide ones on all (worker/engine/threads.py),
so a sequence that goes from decoding alone to decoding beside others changes thread count
between its steps: every kernel must give it the same bits either way. The linears are checked
at SmolLM2's widest layer shape (big enough that their work splits across threads), and whole
runners (attention, norms, sampling included) on a mix of prompts, chunks and batch widths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from canteen.config import parse_config
from tests.support.mixes import run_mix
from tests.support.tiny_model import build_tiny_model
from tests.unit.test_batch_invariance import BLOCK, FORMATS, _wide_mix
from tests.unit.test_lowbit import _weights
from worker import kernels
from worker.config import WorkerConfig
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.engine.threads import SMALL_STEP_MMACS, StepThreads, row_macs
from worker.model.loader import choose_dtype, load_model
from worker.model.quant import pack_groups, pack_lanes

MANY = 4  # more threads than the CI machine's cores still splits every call four ways


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    torch.ops.canteen.set_step_helpers(0)


def _on(threads: int, fn, *args):  # type: ignore[no-untyped-def]
    torch.set_num_threads(threads)
    return fn(*args)


def setup_module() -> None:
    assert kernels.available(), "Canteen's CPU kernels did not build (is g++ installed?)"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_quant_linear_gives_the_same_bits_on_one_thread_and_on_many(bits: int, rows: int) -> None:
    n, k = 3072, 576  # SmolLM2's gate-up projection
    q, d, m = _weights(n, k, bits, seed=rows)
    packed = pack_groups(q, d, m, bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    ops = torch.ops.canteen
    for gate in (False, True):
        args = (x, packed.weights, packed.scales, n, None, None, gate)
        one, many = _on(1, ops.quant_linear, *args), _on(MANY, ops.quant_linear, *args)
        assert torch.equal(one, many), (rows, gate)


@pytest.mark.parametrize("bits", [4, 8])
def test_quant_linear_shared_with_the_step_helper_gives_the_same_bits(bits: int) -> None:
    """A narrow step's linears on one thread and the helper (worker/kernels/share.h), which
    claims chunks whenever it is awake: call after call, the bits of one thread alone."""
    n, k = 3072, 576
    q, d, m = _weights(n, k, bits, seed=bits)
    packed = pack_groups(q, d, m, bits)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(bits)).bfloat16()
    ops = torch.ops.canteen
    torch.set_num_threads(1)
    calls = [(x[:rows], packed.weights, packed.scales, n, None, None, gate)
             for rows in (1, 2, 3) for gate in (False, True)]  # fmt: skip
    alone = [ops.quant_linear(*args) for args in calls]
    ops.set_step_helpers(1)
    for _ in range(40):  # the helper wakes, spins between calls, sleeps, wakes again
        for args, expected in zip(calls, alone, strict=True):
            assert torch.equal(ops.quant_linear(*args), expected)
    with pytest.raises(RuntimeError, match="set_step_helpers: 0 or 1 helper, got 2"):
        ops.set_step_helpers(2)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_skinny_linear_gives_the_same_bits_on_one_thread_and_on_many(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(3072, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    lanes = pack_lanes(weight)
    ops = torch.ops.canteen
    one = _on(1, ops.skinny_linear, x, lanes, 3072, None)
    assert torch.equal(one, _on(MANY, ops.skinny_linear, x, lanes, 3072, None))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-threads"), hidden_size=128, intermediate_size=256
    )


@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
def test_a_mix_gets_the_same_tokens_and_logprobs_on_any_thread_count(
    model_dir: Path, dtype: str, quantization: str
) -> None:
    """64 sequences arriving over steps: all on one thread, all on four, and the worker's
    way (steps of one row on one thread, wider ones on four) give the same bits."""
    device = torch.device("cpu")
    chosen, _ = choose_dtype(dtype, device, quantization)
    loaded = load_model(
        str(model_dir), "safetensors", "", device, chosen, False, quantization=quantization
    )
    mix = _wide_mix(11)
    got = []
    # small_step_mmacs 0: this model's steps would all be small, and run on one thread
    for threads, narrow, small in ((1, 0, 0), (MANY, 0, 0), (MANY, 1, 0), (MANY, 0, 32)):
        torch.set_num_threads(threads)
        config = RunnerConfig(
            6000, BLOCK, 1024, narrow_step_rows=narrow, num_threads=threads, small_step_mmacs=small
        )
        got.append(run_mix(ModelRunner(loaded, config), mix))
    assert got[0] == got[1] == got[2] == got[3]


def test_narrow_steps_run_on_one_thread_and_wider_ones_on_all() -> None:
    threads = StepThreads(narrow_rows=2, num_threads=3)
    assert [threads.apply(rows) for rows in (1, 2, 3, 64, 1)] == [1, 1, 3, 3, 1]
    assert torch.get_num_threads() == 1
    assert StepThreads(narrow_rows=0, num_threads=3).apply(1) == 3
    with pytest.raises(ValueError, match="narrow_rows must be >= 0, got -1"):
        StepThreads(narrow_rows=-1)


def test_small_steps_run_on_one_thread_whatever_their_rows() -> None:
    """Rows times a row's multiply-adds under the bound: one thread; at it or over: all."""
    threads = StepThreads(narrow_rows=0, num_threads=3, row_macs=1_000, small_macs=64_000)
    assert [threads.apply(rows) for rows in (1, 63, 64, 500, 2)] == [1, 1, 3, 3, 1]
    assert StepThreads(0, 3, row_macs=1_000, small_macs=0).apply(1) == 3  # off
    assert StepThreads(0, 3, row_macs=0, small_macs=64_000).apply(1) == 3  # sizes unknown
    with pytest.raises(ValueError, match="row_macs and small_macs must be >= 0, got 5, -1"):
        StepThreads(0, 3, row_macs=5, small_macs=-1)


@pytest.mark.parametrize(
    ("hidden", "inter", "heads", "kv_heads", "tied"),
    [(192, 512, 3, 1, True), (128, 384, 4, 4, False)],  # the first: SmolLM2's heads, smaller
)
def test_a_rows_multiply_adds_are_its_linears_weights(
    hidden: int, inter: int, heads: int, kv_heads: int, tied: bool
) -> None:
    """row_macs counts every weight a token row multiplies: each linear's, and the head's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=3,
        vocab_size=1000,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert row_macs(config) == sum(m.weight.numel() for m in linears)
    assert row_macs(object()) == 0  # no sizes: no step counts as small


def test_a_tiny_models_steps_run_on_one_thread_by_default(model_dir: Path) -> None:
    """The worker's default bound puts every step of a model of a few hundred thousand
    parameters on one thread, 64 rows included; 0 turns it off."""
    device = torch.device("cpu")
    loaded = load_model(str(model_dir), "safetensors", "", device, torch.float32, False)
    assert parse_config(WorkerConfig, [], env={}).small_step_mmacs == SMALL_STEP_MMACS
    default = ModelRunner(loaded, RunnerConfig(100, BLOCK, 1024, num_threads=MANY)).threads
    assert default.threads_for(64) == default.threads_for(1) == 1
    off = RunnerConfig(100, BLOCK, 1024, num_threads=MANY, small_step_mmacs=0)
    assert ModelRunner(loaded, off).threads.threads_for(64) == MANY


def test_one_thread_for_small_steps_refuses_a_negative_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_config(WorkerConfig, ["--small-step-mmacs", "0"], env={}).small_step_mmacs == 0
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--small-step-mmacs", "-1"], env={})
    assert "small_step_mmacs=-1: must be >= 0" in capsys.readouterr().err


def test_one_thread_for_narrow_steps_is_off_by_default_and_refuses_a_negative_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_config(WorkerConfig, [], env={}).narrow_step_rows == 0
    assert parse_config(WorkerConfig, ["--narrow-step-rows", "1"], env={}).narrow_step_rows == 1
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--narrow-step-rows", "-1"], env={})
    assert "narrow_step_rows=-1: must be >= 0" in capsys.readouterr().err
