"""A tiny random 2-layer Llama with a small byte-level BPE tokenizer, built in the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a land far away, there lived a king and a queen.",
    "你好，世界。我们在测试中文和表情符号 🍜🥟🍣 的流式输出。",
    "Canteen batches requests on the fly and streams tokens back one by one.",
] * 20


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(path: Path, seed: int = 0, max_len: int = 1024, **shape: int) -> Path:
    """Writes a transformers directory (safetensors + tokenizer) to ``path``; ``shape``
    overrides the config's sizes (``hidden_size=512``, ``num_key_value_heads=8``, ...)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    sizes: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **shape,
    }
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **sizes,
        max_position_embeddings=max_len,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Sharper logits than the default init, so greedy outputs vary with the prompt.
        model.lm_head.weight.mul_(40.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_adapter(
    base: Path, path: Path, seed: int = 1, r: int = 4, scale: float = 4.0, alpha: int = 8
) -> Path:
    """Writes a PEFT LoRA adapter of the model at ``base`` to ``path`` (adapter_config.json +
    adapter_model.safetensors): every projection adapted, A and B random (B scaled by
    ``scale``), so greedy tokens differ from the base's and between seeds."""
    from peft import LoraConfig, get_peft_model

    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(LORA_TARGETS), init_lora_weights=False
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    path.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(path))
    return path
