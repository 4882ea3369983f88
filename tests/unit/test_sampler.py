"""Sampling whose draws depend only on (seed, position), on small CPU tensors."""

from __future__ import annotations

import pytest
import torch

from canteen.plan import Sampling
from worker.engine.sampler import sample

VOCAB = 10
GREEDY = Sampling(temperature=0.0)


def random_logits(rows: int, vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_argmax_with_its_logprob() -> None:
    logits = random_logits(4)
    tokens, logprobs, _ = sample(logits, [GREEDY] * 4, [0, 5, 9, 100])
    assert tokens == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(4), tokens]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)


def test_sampled_token_logprob_is_log_softmax_at_the_token() -> None:
    logits = random_logits(3)
    samplings = [Sampling(temperature=1.0, seed=s) for s in (1, 2, 3)]
    tokens, logprobs, _ = sample(logits, samplings, [4, 4, 4])
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3), tokens]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)


def test_draw_depends_only_on_seed_and_position_not_the_batch() -> None:
    target = random_logits(1, seed=7)[0]
    mine = Sampling(temperature=1.0, seed=42)
    alone, _, _ = sample(target.unsqueeze(0), [mine], [17])
    others = random_logits(3, seed=8)
    batch = torch.stack([others[0], target, others[1], others[2]])
    samplings = [
        Sampling(temperature=0.7, seed=1),
        mine,
        GREEDY,
        Sampling(temperature=1.3, top_k=5, seed=42),
    ]
    together, _, _ = sample(batch, samplings, [3, 17, 8, 17])
    assert together[1] == alone[0]
    assert sample(target.unsqueeze(0), [mine], [17])[0] == alone  # and again


def test_same_seed_and_position_repeat_across_many_positions() -> None:
    logits = torch.zeros(1, VOCAB)
    sampling = Sampling(temperature=1.0, seed=3)
    first = [sample(logits, [sampling], [p])[0][0] for p in range(50)]
    again = [sample(logits, [sampling], [p])[0][0] for p in range(50)]
    assert first == again


def test_positions_give_varied_draws_on_uniform_logits() -> None:
    logits = torch.zeros(200, VOCAB)
    tokens, _, _ = sample(logits, [Sampling(temperature=1.0, seed=11)] * 200, list(range(200)))
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert (counts > 0).all(), counts.tolist()
    assert counts.max() < 50, counts.tolist()  # about 20 each


def test_seeds_give_different_streams() -> None:
    logits = torch.zeros(40, VOCAB)
    positions = list(range(40))
    a, _, _ = sample(logits, [Sampling(temperature=1.0, seed=1)] * 40, positions)
    b, _, _ = sample(logits, [Sampling(temperature=1.0, seed=2)] * 40, positions)
    assert a != b


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(8, seed=5)
    samplings = [Sampling(temperature=1.5, top_k=1, seed=s) for s in range(8)]
    tokens, _, _ = sample(logits, samplings, list(range(8)))
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_p_tiny_is_greedy() -> None:
    logits = random_logits(8, seed=6)
    samplings = [Sampling(temperature=2.0, top_p=1e-6, seed=s) for s in range(8)]
    tokens, _, _ = sample(logits, samplings, list(range(8)))
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = random_logits(1, vocab=VOCAB, seed=9)
    best = set(logits[0].topk(3).indices.tolist())
    sampling = Sampling(temperature=5.0, top_k=3, seed=4)
    drawn = {sample(logits, [sampling], [p])[0][0] for p in range(100)}
    assert drawn == best


def test_top_k_keeps_exactly_k_tokens_when_logits_tie() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    sampling = Sampling(temperature=1.0, top_k=1, seed=5)
    drawn = {sample(logits, [sampling], [pos])[0][0] for pos in range(50)}
    assert len(drawn) == 1


def test_top_logprobs_are_the_most_likely_tokens_normalised() -> None:
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    _, picked, tops = sample(logits, [Sampling(temperature=0.0, top_logprobs=3), GREEDY], [0, 0])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert [t for t, _ in tops[0]] == [2, 0, 1]
    assert [lp for _, lp in tops[0]] == pytest.approx(expected[[2, 0, 1]].tolist())
    assert picked[0] == pytest.approx(tops[0][0][1])
    assert tops[1] == ()
