"""Canteen's own forward for llama-like families: fewer, bigger ops per layer.

transformers loads the weights; this module takes them over once at load:

    q, k, v projections   -> one fused QKV linear     (worker/model/quant.py prepares the kernel)
    gate, up projections  -> one fused gate-up linear
    attention             -> worker/attention/paged.py, reading the paged pool directly
    rotary                -> applied to q and k together, cos/sin looked up per step in tables
                             transformers' rotary module filled at load (worker/model/rotary.py)

The rotary values and the activation are transformers' own modules', so what they compute is
the reference's computation; so are the RMSNorms, computed on the CPU by Canteen's one-pass
kernel (worker/kernels/, bit-equal in bfloat16, within float32 rounding of the sum's order).
A family is listed in FAMILIES only when this file
reproduces it exactly; the loader keeps transformers' forward for every other one (olmo2:
its norms sit after attention and MLP, and its q/k norms span all heads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from canteen.logging import get_logger
from worker import kernels
from worker.attention.interface import PagedBatch
from worker.attention.paged import kernel_groups, layer_view, paged_attention
from worker.lora.slots import StepLora
from worker.model.arena import gather
from worker.model.quant import (
    Groups,
    Linear,
    PackedLinear,
    cat_groups,
    kernel_form,
    make_linear,
)
from worker.model.rotary import module_rotary, rotary_tables

log = get_logger(__name__)


@dataclass(frozen=True)
class Family:
    """What a family computes beyond plain llama."""

    has_qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k, before rotary
    has_multipliers: bool = False  # granite: embedding, attention, residual, logits scales


FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),  # biased q/k/v: the fused linear carries the concatenated biases
    "qwen3": Family(has_qk_norm=True),
    "granite": Family(has_multipliers=True),
}


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # of q.k before softmax
    residual: float = 1.0
    embedding: float = 1.0
    logits: float = 1.0


def _fused_linear(
    mods: list[nn.Linear], names: list[str], quantization: str, q4: dict[str, Groups]
) -> Linear:
    """One linear computing ``mods`` side by side: their weights (and biases) stacked."""
    weight = torch.cat([m.weight for m in mods]) if len(mods) > 1 else mods[0].weight
    bias = None
    if any(m.bias is not None for m in mods):
        zeros = [m.weight.new_zeros(m.out_features) for m in mods]
        bias = torch.cat(
            [m.bias if m.bias is not None else z for m, z in zip(mods, zeros, strict=True)]
        )
    exact = [q4[n] for n in names if n in q4]
    groups = cat_groups(exact) if len(exact) == len(names) else None
    return make_linear(
        weight.detach(), None if bias is None else bias.detach(), quantization, groups
    )


_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "GraniteRMSNorm")


def _uses_kernels(weight: torch.Tensor) -> bool:
    """Whether a model whose weights live where ``weight`` does runs Canteen's CPU kernels."""
    return weight.is_cpu and kernels.available()


@overload
def _norm(module: nn.Module, fused: bool) -> nn.Module: ...
@overload
def _norm(module: None, fused: bool) -> None: ...
def _norm(module: nn.Module | None, fused: bool) -> nn.Module | None:
    """transformers' RMSNorm ``module``, or with ``fused`` (Canteen's CPU kernels loaded, the
    weights on the CPU) the same computation in the one-pass kernel."""
    if not fused or module is None or type(module).__name__ not in _RMS_NORMS:
        return module
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return _KernelNorm(weight.detach(), float(module.variance_epsilon))  # type: ignore[arg-type]


class _KernelNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.canteen.rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, x * cos + rotate_half(x) * sin, in four ops
    instead of seven: rotate_half(x) * sin == swap_halves(x) * signed_sin, where signed_sin
    negates sin's first half once per step (the same products, bit for bit)."""
    *lead, dim = x.shape
    swapped = x.view(*lead, 2, dim // 2).flip(-2).view(*lead, dim)
    return (x * cos) + (swapped * signed_sin)


class Layer:
    def __init__(
        self, hf: nn.Module, index: int, shape: Shape, quantization: str, q4: dict[str, Groups]
    ) -> None:
        prefix, self.index = f"model.layers.{index}", index
        attn: nn.Module = hf.self_attn  # type: ignore[assignment]
        mlp: nn.Module = hf.mlp  # type: ignore[assignment]

        def fused(owner: nn.Module, kind: str, parts: list[str]) -> Linear:
            mods = [getattr(owner, f"{p}_proj") for p in parts]
            names = [f"{prefix}.{kind}.{p}_proj.weight" for p in parts]
            return _fused_linear(mods, names, quantization, q4)

        self.qkv = fused(attn, "self_attn", ["q", "k", "v"])
        self.o = fused(attn, "self_attn", ["o"])
        self.gate_up = fused(mlp, "mlp", ["gate", "up"])
        self.down = fused(mlp, "mlp", ["down"])
        # Canteen's CPU kernels (worker/kernels/) for the norms, rotary and the SiLU gate,
        # where they compute exactly what the torch ops below do.
        norm_weight: torch.Tensor = hf.input_layernorm.weight  # type: ignore[union-attr,assignment]
        self.fused = _uses_kernels(norm_weight)
        self.input_norm = _norm(hf.input_layernorm, self.fused)  # type: ignore[arg-type]
        self.post_norm = _norm(hf.post_attention_layernorm, self.fused)  # type: ignore[arg-type]
        self.q_norm: nn.Module | None = _norm(getattr(attn, "q_norm", None), self.fused)
        self.k_norm: nn.Module | None = _norm(getattr(attn, "k_norm", None), self.fused)
        self.act: nn.Module = mlp.act_fn  # type: ignore[assignment]
        self.shape = shape
        self.fused_act = self.fused and type(self.act).__name__ in ("SiLUActivation", "SiLU")

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: torch.Tensor,
        batch: PagedBatch,
        lora: StepLora | None = None,
    ) -> torch.Tensor:
        """One layer; ``lora`` adds each row's adapter delta to every linear's output."""
        s, tokens, i = self.shape, x.shape[0], self.index
        h = self.input_norm(x)
        qkv = self.qkv(h) if lora is None else lora.apply(i, "qkv", h, self.qkv(h))
        q_end, k_end = s.heads * s.head_dim, (s.heads + s.kv_heads) * s.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            q = _rotate(self.q_norm(qkv[:, :q_end].view(tokens, -1, s.head_dim)), cos, sin)
            k = _rotate(self.k_norm(qkv[:, q_end:k_end].view(tokens, -1, s.head_dim)), cos, sin)
        elif self.fused:
            heads = qkv.view(tokens, -1, s.head_dim)
            q = torch.ops.canteen.rotary(heads, s.heads, cos, sin)
            k = torch.ops.canteen.rotary(heads[:, s.heads :], s.kv_heads, cos, sin)
        else:
            qk = _rotate(qkv[:, :k_end].view(tokens, -1, s.head_dim), cos, sin)
            q, k = qk[:, : s.heads], qk[:, s.heads :]
        v = qkv[:, k_end:].view(tokens, -1, s.head_dim)
        h = paged_attention(pool, q, k, v, batch, s.scale)
        out = self.o(h) if lora is None else lora.apply(i, "o", h, self.o(h))
        x = x + (out if s.residual == 1.0 else out * s.residual)
        h = self.post_norm(x)
        gate_up = self.gate_up(h) if lora is None else lora.apply(i, "gate_up", h, self.gate_up(h))
        if self.fused_act:  # torch's silu and mul in one pass, bit for bit
            h = torch.ops.canteen.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        out = self.down(h) if lora is None else lora.apply(i, "down", h, self.down(h))
        return x + (out if s.residual == 1.0 else out * s.residual)


@dataclass(frozen=True)
class Stack:
    """What canteen::decode_layers (worker/kernels/stack.cpp) takes of every layer: the same
    ops as ``Layer``, in one call, for every step."""

    weights: list[torch.Tensor]  # per layer: the two norms, then (a, b, bias) per linear
    sizes: list[int]  # per layer: each linear's output features
    eps: float


def _stack(layers: list[Layer]) -> Stack | None:
    """The layers as one op takes them, where every layer runs on Canteen's kernels: norms,
    SiLU gate, no q/k norms, and linears with a kernel of their own."""
    weights: list[torch.Tensor] = []
    sizes, eps = [], set[float]()
    for layer in layers:
        norms = [n for n in (layer.input_norm, layer.post_norm) if isinstance(n, _KernelNorm)]
        if not layer.fused_act or layer.q_norm is not None or layer.k_norm is not None:
            return None
        if len(norms) != 2:
            return None
        weights += [n.weight for n in norms]
        eps |= {n.eps for n in norms}
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            form = kernel_form(linear)
            if form is None:
                return None
            weights += form[0]
            sizes.append(form[1])
    if not layers or len(eps) != 1:
        return None
    return Stack(weights, sizes, eps.pop())


class FastModel:
    """The decoder over one flattened step: token ids [T] -> logits [len(keep), vocab], or
    [T, vocab] with ``keep`` None (every row kept)."""

    def __init__(self, hf: PreTrainedModel, quantization: str, q4: dict[str, Groups]) -> None:
        config = hf.config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        scaled = FAMILIES[config.model_type].has_multipliers
        self.shape = Shape(
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            scale=config.attention_multiplier if scaled else head_dim**-0.5,
            residual=config.residual_multiplier if scaled else 1.0,
            embedding=config.embedding_multiplier if scaled else 1.0,
            logits=config.logits_scaling if scaled else 1.0,
        )
        body = hf.model
        self.embed = body.embed_tokens.weight.detach()
        self.rotary = body.rotary_emb
        # every position the model serves (the worker's context is max_position_embeddings)
        self.rotary_tables = rotary_tables(
            self.rotary, config.max_position_embeddings, self.embed.dtype, self.embed.device
        )
        self.norm = _norm(body.norm, _uses_kernels(body.norm.weight))
        self.layers = [
            Layer(layer, i, self.shape, quantization, q4) for i, layer in enumerate(body.layers)
        ]
        # The head decides every token: it stays at 8 bits under int4 (a GGUF's Q8_0 head, or
        # its tied Q8_0 embedding, as shipped).
        head_quantization = "int8" if quantization == "int4" else quantization
        self.lm_head = make_linear(
            hf.lm_head.weight.detach(), hf.lm_head.bias, head_quantization, q4.get("lm_head.weight")
        )
        for layer in body.layers:
            # The fused copies replace these; free transformers' per-projection weights.
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer.self_attn, name, None)
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(layer.mlp, name, None)
        self.stack = _stack(self.layers)
        gather(self._read_order())  # one stream of huge pages for a step to read (arena.py)
        self._warm_up()

    def _read_order(self) -> list[torch.Tensor]:
        """The tensors Canteen's kernels read of every linear, in the order a step reads them."""
        out: list[torch.Tensor] = []
        linears = [lin for lay in self.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        for linear in [*linears, self.lm_head]:
            form = kernel_form(linear)
            out += [t for t in form[0][:2] if t.numel()] if form else []  # (a, b), not the bias
        return out

    def _warm_up(self) -> None:
        """Builds every kernel a prepacked linear will need (worker/model/quant.py) now, so that
        the memory budget measured after load covers them and no step stalls to build one.
        Layers share shapes, so the first layer and the head stand for all."""
        first = self.layers[0]
        packed = [
            lin
            for lin in (first.qkv, first.o, first.gate_up, first.down, self.lm_head)
            if isinstance(lin, PackedLinear)
        ]
        if not packed:
            return
        started = time.perf_counter()
        with torch.inference_mode():
            for lin in packed:
                lin.warm_up()
        log.info("prepacked linears warmed", seconds=round(time.perf_counter() - started, 2))

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        keep: torch.Tensor | None,
        lora: StepLora | None = None,
    ) -> torch.Tensor:
        """``lora``: the step's adapters, applied inside decode_layers where every adapter
        linear has a lanes layout, else layer by layer (the same bits either way)."""
        x = F.embedding(input_ids, self.embed)
        if self.shape.embedding != 1.0:
            x = x * self.shape.embedding
        # [T, 1, head_dim] each; sin signed for _rotate
        tables = self.rotary_tables
        cos, sin = (
            module_rotary(self.rotary, positions, x.dtype) if tables is None else tables(positions)
        )
        stack = self.stack
        kernel_lora = None if lora is None else lora.kernel_args()
        if stack is not None and (lora is None or kernel_lora is not None):
            x = self._decode_layers(stack, x, cos, sin, batch, kernel_lora)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, layer_view(batch.kv_pool, i), batch, lora)
        logits = self.lm_head(self.norm(x if keep is None else x.index_select(0, keep)))
        return logits if self.shape.logits == 1.0 else logits / self.shape.logits

    def _decode_layers(
        self,
        stack: Stack,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        b: PagedBatch,
        lora: tuple[list[torch.Tensor], list[int]] | None = None,
    ) -> torch.Tensor:
        """Every layer in one op (the Layer ops, bit for bit, without the Python between)."""
        s = self.shape
        groups = [t for g in kernel_groups(b) for t in g]
        lora_list, lora_sizes = ([], []) if lora is None else lora
        out: torch.Tensor = torch.ops.canteen.decode_layers(
            x,
            b.kv_pool,
            stack.weights,
            stack.sizes,
            cos,
            sin,
            b.slot_mapping,
            groups,
            s.heads,
            s.kv_heads,
            s.scale,
            stack.eps,
            s.residual,
            lora_list,
            lora_sizes,
        )
        return out
