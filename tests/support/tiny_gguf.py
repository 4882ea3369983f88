"""A tiny random llama GGUF, written in the test: Q4_1 (or Q8_0) decoder linears and a Q8_0
token embedding tied to the head, as SmolLM2's package ships them, small enough for unit tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 128, 256, 2, 4, 2, 300


def write_tiny_gguf(
    path: Path, linears: GGMLQuantizationType = GGMLQuantizationType.Q4_1, seed: int = 0
) -> Path:
    """Writes the model to ``path`` (a .gguf file) and returns it."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], kind: GGMLQuantizationType, scale: float) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, 1 + data)
        else:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)

    f32, q8 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0
    head_dim = HIDDEN // HEADS
    add("token_embd.weight", (VOCAB, HIDDEN), q8, 0.5)
    add("output_norm.weight", (HIDDEN,), f32, 0.1)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), f32, 0.1)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), f32, 0.1)
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, HIDDEN), linears, 0.1)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), linears, 0.1)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), linears, 0.1)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * head_dim), linears, 0.1)
        add(f"blk.{i}.ffn_gate.weight", (INTERMEDIATE, HIDDEN), linears, 0.1)
        add(f"blk.{i}.ffn_up.weight", (INTERMEDIATE, HIDDEN), linears, 0.1)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, INTERMEDIATE), linears, 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
