"""LoRA adapters on the worker: the tokens of transformers + peft, alone and mixed in one step,
on float32, bfloat16 and int4 bases; --max-loras eviction; refused adapters (issue 35)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from canteen.adapters import AdapterRef
from canteen.models import adapter_sha256
from canteen.plan import NewSequence, Sampling, ScheduledSequence, StepPlan, StepResult
from worker.engine.runner import ModelRunner, RunnerConfig
from worker.lora.store import LoraOptions
from worker.model.loader import load_model

BLOCK = 8
VOCAB = 256
NEW = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[(i * 37 + j * 11) % (VOCAB - 3) + 3 for j in range(5 + 6 * i)] for i in range(4)]

Job = tuple[list[int], AdapterRef | None]


def _base(path: Path) -> Path:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # sharp logits: greedy tokens depend on the prompt
    model.save_pretrained(path)
    return path


def _adapter(
    base: Path, path: Path, seed: int, rank: int = 8, use_rslora: bool = False
) -> AdapterRef:
    """A peft adapter over ``base`` with random B (peft starts B at zero: no effect)."""
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, use_rslora=use_rslora)
    peft = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    peft.save_pretrained(str(path))
    return AdapterRef(path.name, "1", str(path), adapter_sha256(path))


def _peft_tokens(base: Path, adapter: AdapterRef | None, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter.path).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


def _runner(
    base: Path,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
    max_loras: int = 4,
    max_cpu_loras: int = 8,
) -> ModelRunner:
    loaded = load_model(
        str(base), "safetensors", "", torch.device("cpu"), dtype, False, quantization=quantization
    )
    config = RunnerConfig(
        8 * 8, BLOCK, max_batched_tokens=256, lora=LoraOptions(max_loras, max_cpu_loras)
    )
    return ModelRunner(loaded, config)


def _generate(
    runner: ModelRunner, jobs: dict[str, Job], groups: list[list[str]] | None = None
) -> tuple[dict[str, list[int]], list[StepResult]]:
    """Greedy tokens per sequence; ``groups``: which sequences each step runs, in turn
    (default: all of them every step)."""
    runner.reset()
    per = runner.blocks_for(max(len(p) for p, _ in jobs.values()) + NEW)
    blocks = {s: tuple(range(i * per, (i + 1) * per)) for i, s in enumerate(jobs)}
    groups = groups or [list(jobs)]
    out: dict[str, list[int]] = {s: [] for s in jobs}
    results, started, step = [], set[str](), 0
    while any(len(t) < NEW for t in out.values()):
        group = [s for s in groups[step % len(groups)] if len(out[s]) < NEW]
        fresh = [s for s in group if s not in started]
        new = tuple(
            NewSequence(s, tuple(jobs[s][0]), Sampling(0.0), blocks[s], adapter=jobs[s][1])
            for s in fresh
        )
        scheduled = tuple(ScheduledSequence(s, len(jobs[s][0]) if s in fresh else 1) for s in group)
        result = runner.step(StepPlan(step, new, scheduled))
        started |= set(fresh)
        results.append(result)
        assert not result.failed, result.failed
        for token in result.tokens:
            out[token.seq_id].append(token.token_id)
        step += 1
    return out, results


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[AdapterRef]]:
    root = tmp_path_factory.mktemp("lora")
    base = _base(root / "base")
    adapters = [_adapter(base, root / f"a{i}", seed=i + 1) for i in range(4)]
    return base, adapters


def test_each_adapter_alone_and_mixed_decodes_the_tokens_of_peft(
    models: tuple[Path, list[AdapterRef]],
) -> None:
    base, adapters = models
    runner = _runner(base)
    jobs: dict[str, Job] = {f"s{i}": (PROMPTS[i], a) for i, a in enumerate(adapters[:3])}
    jobs["base"] = (PROMPTS[3], None)
    mixed, _ = _generate(runner, jobs)
    for seq_id, (prompt, adapter) in jobs.items():
        alone, _ = _generate(runner, {seq_id: (prompt, adapter)})
        assert mixed[seq_id] == alone[seq_id] == _peft_tokens(base, adapter, prompt), seq_id
    # the adapters matter: each turns the same prompt into other tokens than the base
    plain, _ = _generate(runner, {s: (p, None) for s, (p, _) in jobs.items()})
    assert all(plain[s] != mixed[s] for s in ("s0", "s1", "s2"))


def test_rslora_scales_by_the_square_root_of_the_rank(
    models: tuple[Path, list[AdapterRef]], tmp_path: Path
) -> None:
    base, _ = models
    adapter = _adapter(base, tmp_path / "rs", seed=9, rank=16, use_rslora=True)
    assert json.loads((tmp_path / "rs" / "adapter_config.json").read_text())["use_rslora"]
    runner = _runner(base)
    tokens, _ = _generate(runner, {"rs": (PROMPTS[1], adapter)})
    assert tokens["rs"] == _peft_tokens(base, adapter, PROMPTS[1])
    # scaled by alpha / r instead (a plain adapter with the same weights) gives other tokens
    plain = json.loads((tmp_path / "rs" / "adapter_config.json").read_text())
    plain["use_rslora"] = False
    (tmp_path / "rs" / "adapter_config.json").write_text(json.dumps(plain))
    other = AdapterRef("rs-plain", "1", adapter.path, adapter_sha256(Path(adapter.path)))
    assert _generate(runner, {"rs": (PROMPTS[1], other)})[0]["rs"] != tokens["rs"]


@pytest.mark.parametrize(
    ("dtype", "quantization"), [(torch.bfloat16, "none"), (torch.bfloat16, "int4")]
)
def test_a_low_precision_base_gives_an_adapter_the_same_tokens_alone_and_mixed(
    models: tuple[Path, list[AdapterRef]], dtype: torch.dtype, quantization: str
) -> None:
    base, adapters = models
    runner = _runner(base, dtype, quantization)
    jobs: dict[str, Job] = {f"s{i}": (PROMPTS[i], a) for i, a in enumerate(adapters[:3])}
    jobs["base"] = (PROMPTS[3], None)
    mixed, _ = _generate(runner, jobs)
    plain, _ = _generate(runner, {s: (p, None) for s, (p, _) in jobs.items()})
    for seq_id, job in jobs.items():
        assert mixed[seq_id] == _generate(runner, {seq_id: job})[0][seq_id], seq_id
    assert mixed["base"] == plain["base"]
    assert all(plain[s] != mixed[s] for s in ("s0", "s1", "s2"))


def test_max_loras_two_with_four_adapters_in_flight_evicts_and_finishes_exactly(
    models: tuple[Path, list[AdapterRef]],
) -> None:
    base, adapters = models
    jobs: dict[str, Job] = {f"s{i}": (PROMPTS[i], a) for i, a in enumerate(adapters)}
    runner = _runner(base, max_loras=2, max_cpu_loras=2)
    # the scheduler's rule: at most two distinct adapters a step, so pairs take turns
    out, results = _generate(runner, jobs, groups=[["s0", "s1"], ["s2", "s3"], ["s1", "s2"]])
    for seq_id, (prompt, adapter) in jobs.items():
        assert out[seq_id] == _peft_tokens(base, adapter, prompt), seq_id
    assert runner.lora.slots.num_evictions >= 2
    assert runner.lora.store.num_evictions >= 2
    assert runner.lora.store.num_loads > len(adapters)  # evicted ones came back from disk
    changes = [r.resident_adapters for r in results if r.adapters_changed]
    assert changes[0] == ("a0:1", "a1:1")
    assert all(len(c) <= 2 for c in changes) and len(changes) >= 3


def test_a_third_distinct_adapter_in_one_step_fails_its_sequence_only(
    models: tuple[Path, list[AdapterRef]],
) -> None:
    base, adapters = models
    runner = _runner(base, max_loras=2)
    new = tuple(
        NewSequence(
            f"s{i}", tuple(PROMPTS[i]), Sampling(0.0), (i * 4, i * 4 + 1, i * 4 + 2), adapter=a
        )
        for i, a in enumerate(adapters[:3])
    )
    plan = StepPlan(0, new, tuple(ScheduledSequence(n.seq_id, len(n.token_ids)) for n in new))
    result = runner.step(plan)
    assert [(f.seq_id, f.error, f.is_request_error) for f in result.failed] == [
        ("s2", "sequence s2: adapter a2:1 would make 3 distinct adapters in this step; "
         "--max-loras is 2", False)
    ]  # fmt: skip
    assert sorted(t.seq_id for t in result.tokens) == ["s0", "s1"]


def test_an_adapter_changed_after_registration_is_refused_with_the_digest_mismatch(
    models: tuple[Path, list[AdapterRef]], tmp_path: Path
) -> None:
    base, _ = models
    adapter = _adapter(base, tmp_path / "changed", seed=7)
    config = tmp_path / "changed" / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 64'))
    actual = adapter_sha256(tmp_path / "changed")
    runner = _runner(base)
    new = (
        NewSequence("bad", tuple(PROMPTS[0]), Sampling(0.0), (0, 1), adapter=adapter),
        NewSequence("good", tuple(PROMPTS[0]), Sampling(0.0), (2, 3)),
    )
    result = runner.step(StepPlan(0, new, tuple(ScheduledSequence(n.seq_id, 5) for n in new)))
    assert [(f.seq_id, f.error, f.is_request_error) for f in result.failed] == [
        (
            "bad",
            f"sequence bad: adapter changed:1: checksum mismatch for {adapter.path}: registry "
            f"has {adapter.sha256}, files have {actual} (the sha256 covers adapter_config.json "
            "and adapter_model.safetensors)",
            True,
        )
    ]
    assert [t.seq_id for t in result.tokens] == ["good"]
    assert runner.lora.store.num_loads == 0


def test_max_loras_zero_refuses_adapters(models: tuple[Path, list[AdapterRef]]) -> None:
    base, adapters = models
    runner = _runner(base, max_loras=0)
    new = (NewSequence("s", tuple(PROMPTS[0]), Sampling(0.0), (0, 1), adapter=adapters[0]),)
    result = runner.step(StepPlan(0, new, (ScheduledSequence("s", 5),)))
    assert [(f.error, f.is_request_error) for f in result.failed] == [
        ("sequence s: adapter a0:1: this worker serves no LoRA adapters (--max-loras 0)", True)
    ]


def test_an_adapter_sequence_may_not_claim_blocks_the_base_computed(
    models: tuple[Path, list[AdapterRef]],
) -> None:
    base, adapters = models
    runner = _runner(base)
    prompt = tuple(PROMPTS[2])  # 17 tokens: two full blocks of 8
    first = NewSequence("first", prompt, Sampling(0.0), (0, 1, 2))
    assert not runner.step(StepPlan(0, (first,), (ScheduledSequence("first", 17),))).failed

    def claim(seq_id: str, adapter: AdapterRef | None) -> StepResult:
        new = NewSequence(seq_id, prompt, Sampling(0.0), (0, 3, 4), 8, adapter=adapter)
        return runner.step(StepPlan(1, (new,), (ScheduledSequence(seq_id, 9),)))

    refused = claim("lora", adapters[0])
    assert [f.error for f in refused.failed] == [
        "sequence lora: block 0 does not hold its tokens 0..7 (num_cached_tokens claims it does)"
    ]
    assert not claim("plain", None).failed  # the base's own chain: the same blocks are its


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_applies_adapters_with_the_bits_of_the_layer_path(
    models: tuple[Path, list[AdapterRef]], dtype: torch.dtype
) -> None:
    """A mixed step runs inside canteen::decode_layers (each adapter's products on its own
    rows): the hidden states before the head are the Layer loop's bit for bit."""
    from worker.model.forward import FastModel

    base, adapters = models
    runner = _runner(base, dtype)
    model = runner.loaded.forward
    assert isinstance(model, FastModel) and model.stack is not None
    stack, norm = model.stack, model.norm
    assert norm is not None
    jobs: dict[str, Job] = {f"s{i}": (PROMPTS[i], a) for i, a in enumerate(adapters[:3])}
    jobs["base"] = (PROMPTS[3], None)
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    tokens: dict[bool, dict[str, list[int]]] = {}
    for use in (True, False):
        model.stack = stack if use else None
        model.norm = lambda x, use=use: seen[use].append(x.clone()) or norm(x)  # type: ignore[func-returns-value]
        tokens[use] = _generate(runner, jobs)[0]
    model.stack, model.norm = stack, norm
    step = runner.lora.step([(a, 1) for a in adapters[:3]], torch.device("cpu"))
    assert step is not None and step.kernel_args() is not None  # the op took the adapters
    assert tokens[True] == tokens[False]
    assert len(seen[True]) == len(seen[False]) == NEW
    for fused, layered in zip(seen[True], seen[False], strict=True):
        assert torch.equal(fused, layered)
