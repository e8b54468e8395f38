"""filter_logits and sample_next against hand-worked distributions."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.rollout.sampling import filter_logits, sample_next

PROBS = [0.5, 0.3, 0.15, 0.05]


def kept(logits: torch.Tensor, **kw) -> list[list[bool]]:
    return torch.isfinite(filter_logits(logits, **kw)).tolist()


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.tensor([PROBS]).log()


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, [True, False, False, False]),  # 0.5 alone already reaches 0.4
        (0.5, [True, False, False, False]),
        (0.75, [True, True, False, False]),
        (0.8, [True, True, False, False]),  # 0.5 + 0.3 reaches 0.8 exactly
        (0.85, [True, True, True, False]),
        (0.99, [True, True, True, True]),
        (1.0, [True, True, True, True]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(logits: torch.Tensor, top_p: float, expected) -> None:
    assert kept(logits, top_p=top_p) == [expected]


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (1, [True, False, False, False]),
        (2, [True, True, False, False]),
        (3, [True, True, True, False]),
        (0, [True, True, True, True]),  # 0 disables top-k
        (9, [True, True, True, True]),
    ],
)
def test_top_k_keeps_the_k_largest(logits: torch.Tensor, top_k: int, expected) -> None:
    assert kept(logits, top_k=top_k) == [expected]


def test_filters_work_per_row_in_any_vocabulary_order() -> None:
    perm = torch.tensor([2, 0, 3, 1])  # row 0 holds PROBS permuted, row 1 reversed
    rows = torch.stack([torch.tensor(PROBS)[perm], torch.tensor(PROBS).flip(0)]).log()
    assert kept(rows, top_p=0.8) == [[False, True, False, True], [False, False, True, True]]
    assert kept(rows, top_k=2) == [[False, True, False, True], [False, False, True, True]]


def test_top_p_applies_to_the_top_k_renormalised_distribution(logits: torch.Tensor) -> None:
    # top-k=2 leaves [0.625, 0.375]; 0.625 alone reaches 0.6. Top-p=0.6 alone keeps two.
    assert kept(logits, top_p=0.6) == [[True, True, False, False]]
    assert kept(logits, top_k=2, top_p=0.6) == [[True, False, False, False]]


def test_kept_logits_are_unchanged(logits: torch.Tensor) -> None:
    out = filter_logits(logits, top_k=3, top_p=0.85)
    assert torch.equal(out[:, :3], logits[:, :3])


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "allowed", "expected_freq"),
    [
        # top-p 0.8 keeps {0, 1}: renormalised 0.5/0.8 = 0.625 for token 0
        (1.0, 0, 0.8, {0, 1}, 0.625),
        # T=0.5 squares the probabilities: 0.25 / (0.25 + 0.09) for token 0 among the top 2
        (0.5, 2, 1.0, {0, 1}, 0.25 / 0.34),
        (1.0, 0, 1.0, {0, 1, 2, 3}, 0.5),
    ],
)
def test_sampling_never_picks_a_filtered_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, allowed: set[int],
    expected_freq: float,
) -> None:
    draws = 20_000
    many = logits.expand(draws, -1).contiguous()
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(many, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    assert set(tokens.unique().tolist()) == allowed
    freq = float((tokens == 0).float().mean())
    sigma = math.sqrt(expected_freq * (1 - expected_freq) / draws)
    assert abs(freq - expected_freq) < 5 * sigma
    # the reported log-prob is that of the temperature-scaled, unfiltered distribution
    scaled = torch.log_softmax(torch.tensor(PROBS).log() / temperature, dim=-1)
    torch.testing.assert_close(logp, scaled[tokens], rtol=0, atol=1e-6)


def test_greedy_takes_the_argmax_and_reports_the_t1_logprob() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens, logp = sample_next(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]], rtol=0, atol=1e-7)
