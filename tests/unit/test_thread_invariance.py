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
from worker.engine.threads import StepThreads
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
    for threads, narrow in ((1, 0), (MANY, 0), (MANY, 1)):
        torch.set_num_threads(threads)
        config = RunnerConfig(6000, BLOCK, 1024, narrow_step_rows=narrow, num_threads=threads)
        got.append(run_mix(ModelRunner(loaded, config), mix))
    assert got[0] == got[1] == got[2]


def test_narrow_steps_run_on_one_thread_and_wider_ones_on_all() -> None:
    threads = StepThreads(narrow_rows=2, num_threads=3)
    assert [threads.apply(rows) for rows in (1, 2, 3, 64, 1)] == [1, 1, 3, 3, 1]
    assert torch.get_num_threads() == 1
    assert StepThreads(narrow_rows=0, num_threads=3).apply(1) == 3
    with pytest.raises(ValueError, match="narrow_rows must be >= 0, got -1"):
        StepThreads(narrow_rows=-1)


def test_one_thread_for_narrow_steps_is_off_by_default_and_refuses_a_negative_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_config(WorkerConfig, [], env={}).narrow_step_rows == 0
    assert parse_config(WorkerConfig, ["--narrow-step-rows", "1"], env={}).narrow_step_rows == 1
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--narrow-step-rows", "-1"], env={})
    assert "narrow_step_rows=-1: must be >= 0" in capsys.readouterr().err
