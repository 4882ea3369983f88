"""Per-sequence sampling whose randomness is a function of (seed, position) only.

The same seed gives the same tokens whatever else is in the batch, and a sequence re-run on
another worker after a preemption or failover continues with exactly the tokens it would
have produced.
"""

from __future__ import annotations

import torch

from canteen.plan import Sampling
from worker import kernels

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a well-mixed 63-bit seed for one draw."""
    z = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _filtered_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        # Keep exactly k tokens (by index), even when logits tie at the k-th value.
        top = torch.topk(scaled, sampling.top_k)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(0, top.indices, top.values)
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keep at least one).
        drop = (cumulative - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def _picks_in_kernel(logits: torch.Tensor) -> bool:
    """Canteen's greedy_pick takes these logits as they are (bfloat16 widened row by row)."""
    return logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16) and kernels.available()


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` [N, V], ranked in float32: the largest logit, its first index,
    and the logsumexp (a token's logprob is its logit minus it). On the CPU one pass of
    Canteen's kernel (worker/kernels/sampling.cpp) where torch's max and logsumexp take
    several, reading bfloat16 logits as they are."""
    if _picks_in_kernel(logits):
        best, chosen, norm = torch.ops.canteen.greedy_pick(logits, True)
        return best, chosen, norm
    logits = logits.float()
    best, chosen = logits.max(dim=-1)
    return best, chosen, torch.logsumexp(logits, dim=-1)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first largest logit's index per row of ``logits`` [N, V] (torch.argmax's)."""
    if _picks_in_kernel(logits):
        chosen: list[int] = torch.ops.canteen.greedy_pick(logits, False)[1].tolist()
        return chosen
    result: list[int] = logits.float().argmax(dim=-1).tolist()
    return result


def sample(
    logits: torch.Tensor, samplings: list[Sampling], positions: list[int]
) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
    """Picks one token per row of ``logits`` [N, V]: token ids, their logprobs, and the
    most likely (token, logprob) pairs of the rows that asked for top_logprobs."""
    # greedy rows: one batched max gives the token and its logit together (bfloat16 logits
    # are ranked in float32)
    best, chosen, norm = greedy_pick(logits)
    sampled = [row for row, s in enumerate(samplings) if not s.is_greedy]
    has_tops = any(s.top_logprobs > 0 for s in samplings)
    if sampled or has_tops:
        logits = logits.float()  # a no-op in float32
    for row in sampled:
        sampling = samplings[row]
        probs = _filtered_probs(logits[row], sampling)
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(position_seed(sampling.seed, positions[row]))
        chosen[row] = torch.multinomial(probs, 1, generator=generator)[0]
    if sampled:
        best = logits.gather(1, chosen.unsqueeze(1)).squeeze(1)
    if not has_tops:
        return chosen.tolist(), (best - norm).tolist(), [()] * len(samplings)
    tops: list[tuple[tuple[int, float], ...]] = []
    for row, sampling in enumerate(samplings):
        if sampling.top_logprobs <= 0:
            tops.append(())
            continue
        top = torch.topk(logits[row], min(sampling.top_logprobs, logits.shape[-1]))
        values = (top.values - norm[row]).tolist()
        tops.append(tuple(zip(top.indices.tolist(), values, strict=True)))
    return chosen.tolist(), (best - norm).tolist(), tops
