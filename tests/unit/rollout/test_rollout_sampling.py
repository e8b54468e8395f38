"""filter_logits, inverse_cdf and sample_next against hand-worked distributions."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.rollout.sampling import BLOCK, filter_logits, inverse_cdf, sample_next

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


BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 below 1, the largest value torch.rand draws


@pytest.mark.parametrize(
    ("weights", "uniform", "expected"),
    [
        # cumulative [0, 0.5, 0.5, 1]: the first entry above u is token 1 up to u = 0.5, then 3
        ([0.0, 0.5, 0.0, 0.5], 0.0, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.499, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.5, 3),
        ([0.0, 0.5, 0.0, 0.5], BELOW_ONE, 3),
        # trailing zero weights: u just below 1 stays on the last positive token
        ([0.5, 0.5, 0.0, 0.0], BELOW_ONE, 1),
        # unnormalised: cumulative [2, 8], total 8; token 0 up to u = 0.25
        ([2.0, 6.0], 0.2499, 0),
        ([2.0, 6.0], 0.25, 1),
    ],
)
def test_inverse_cdf_by_hand(weights: list[float], uniform: float, expected: int) -> None:
    out = inverse_cdf(torch.tensor([weights]), torch.tensor([uniform], dtype=torch.float64))
    assert out.tolist() == [expected]


@pytest.mark.parametrize(
    ("uniform", "expected"),
    [(0.0, 5), (0.2499, 5), (0.25, BLOCK + 3), (0.7499, BLOCK + 3), (0.75, 2 * BLOCK + 9), (BELOW_ONE, 2 * BLOCK + 9)],
)
def test_inverse_cdf_across_blocks_by_hand(uniform: float, expected: int) -> None:
    # three blocks, the last one 10 entries long; weights 1, 2, 1 at three entries: the
    # running sum is 1 from 5, 3 from BLOCK + 3, 4 from 2 BLOCK + 9 (the vocabulary's last)
    weights = torch.zeros(1, 2 * BLOCK + 10)
    weights[0, [5, BLOCK + 3, 2 * BLOCK + 9]] = torch.tensor([1.0, 2.0, 1.0])
    assert inverse_cdf(weights, torch.tensor([uniform], dtype=torch.float64)).tolist() == [expected]


def test_inverse_cdf_skips_an_empty_block() -> None:
    weights = torch.zeros(2, 3 * BLOCK)
    weights[:, 7] = 1.0
    weights[:, 2 * BLOCK] = 1.0  # the middle block holds nothing
    out = inverse_cdf(weights, torch.tensor([0.4999, 0.5], dtype=torch.float64))
    assert out.tolist() == [7, 2 * BLOCK]


@pytest.mark.parametrize("last_positive", [False, True])
@pytest.mark.parametrize("vocab", [40, BLOCK, 2 * BLOCK + 300])
def test_inverse_cdf_never_returns_a_zero_weight_token(vocab: int, last_positive: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    weights = torch.rand(64, vocab, generator=gen)
    weights[torch.rand(64, vocab, generator=gen) < 0.6] = 0.0
    weights[:, 0] = 0.0  # never first
    weights[:, -1] = 1.0 if last_positive else 0.0  # a partial last block ending in a token, or in zeros
    weights[:, 17] += 1e-30  # at least one positive weight a row (a tiny share)
    ends = torch.tensor([0.0, 1e-300, 0.5, BELOW_ONE], dtype=torch.float64)
    for u in (*ends, *torch.rand(50, dtype=torch.float64, generator=gen)):
        tokens = inverse_cdf(weights, u.expand(64))
        assert bool((tokens < vocab).all())
        assert bool((weights.gather(1, tokens[:, None]) > 0).all())
    if last_positive:  # the largest uniform lands on the vocabulary's last token
        assert inverse_cdf(weights, torch.full((64,), BELOW_ONE, dtype=torch.float64)).tolist() == [vocab - 1] * 64


def test_a_share_below_the_float32_rounding_of_the_total_can_be_drawn() -> None:
    # float32 sums 1 + 5e-8 to exactly 1; the token of weight 5e-8 must still own the
    # top 5e-8 of the range (its share of the block's float64 running sum)
    weights = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 5e-8, 0.0, 0.0]])
    draw = [inverse_cdf(weights, torch.tensor([u], dtype=torch.float64)).item() for u in (1 - 1e-7, 1 - 1e-8)]
    assert draw == [0, 5]


def test_inverse_cdf_agrees_with_one_float64_running_sum() -> None:
    # the reference: one float64 running sum over the whole row, then the same search
    gen = torch.Generator().manual_seed(5)
    weights = torch.softmax(torch.randn(8, 5 * BLOCK + 77, generator=gen) * 3, dim=-1)
    weights[:, ::7] = 0.0
    cumulative = weights.double().cumsum(-1)
    agree = 0
    for _ in range(2_000):
        u = torch.rand(8, dtype=torch.float64, generator=gen)
        reference = torch.searchsorted(cumulative, (u * cumulative[:, -1])[:, None], right=True).squeeze(1)
        agree += int((inverse_cdf(weights, u) == reference).sum())
    # A draw can differ only where the float32 rounding of a block's total shifts a
    # boundary past the point: a share of the range of at most the blocks' relative
    # rounding, BLOCK float32 eps (6e-5) at worst, so at most ~1 of the 16,000 draws is
    # expected (cascaded sums round far less); 16 leaves room and still fails any real slip.
    assert agree >= 16_000 - 16


def test_sampled_frequencies_match_every_probability() -> None:
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(50, generator=gen) * 2, dim=0)
    draws = 40_000
    tokens, _ = sample_next(probs.log().expand(draws, -1), temperature=1.0, generator=gen)
    freq = torch.bincount(tokens, minlength=50).double() / draws
    sigma = (probs.double() * (1 - probs.double()) / draws).sqrt()
    # 5 sigma a token: with 50 tokens a false failure has probability ~3e-5
    assert bool(((freq - probs.double()).abs() <= 5 * sigma + 1e-12).all())


def test_sampled_frequencies_across_blocks() -> None:
    # 40 likely tokens spread over three blocks (the last one partial), the rest unlikely
    gen = torch.Generator().manual_seed(6)
    vocab = 2 * BLOCK + 300
    logits = torch.full((vocab,), -12.0)
    likely = torch.randperm(vocab, generator=gen)[:40]
    logits[likely] = torch.randn(40, generator=gen)
    probs = torch.softmax(logits, dim=0).double()
    draws = 40_000
    tokens, _ = sample_next(logits.expand(draws, -1), temperature=1.0, generator=gen)
    freq = torch.bincount(tokens, minlength=vocab).double() / draws
    sigma = (probs * (1 - probs) / draws).sqrt()
    # 5 sigma a token; an unlikely one (p ~ 2e-7, 0.01 expected draws) drawn once is
    # 1 / draws above its probability, hence that term
    assert bool(((freq - probs).abs() <= 5 * sigma + 1.0 / draws).all())
    assert float(freq[likely].sum()) > 0.99


def test_sample_next_draws_with_one_float64_uniform_a_row() -> None:
    logits = torch.randn(6, 3 * BLOCK + 11, generator=torch.Generator().manual_seed(7))
    tokens, _ = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(8))
    uniform = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(tokens, inverse_cdf(torch.softmax(logits, dim=-1), uniform))


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = torch.randn(4, 2 * BLOCK + 5, generator=torch.Generator().manual_seed(9))
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        tokens, logp = sample_next(low, temperature=1.0, generator=torch.Generator().manual_seed(10))
        same, same_logp = sample_next(low.float(), temperature=1.0, generator=torch.Generator().manual_seed(10))
        assert torch.equal(tokens, same) and logp.dtype == torch.float32
        torch.testing.assert_close(logp, same_logp, rtol=0, atol=0)


def test_sampling_is_reproducible_from_the_generator() -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    draw = [sample_next(logits, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(4))[0]
            for _ in range(2)]
    assert torch.equal(draw[0], draw[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_broken_logits_name_their_rows(bad: float) -> None:
    logits = torch.zeros(4, 6)
    logits[2, 3] = bad
    with pytest.raises(ValueError, match=r"row\(s\) \[2\] \(of 4\) hold NaN or infinite"):
        sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))


def test_a_row_with_every_token_masked_is_refused() -> None:
    logits = torch.zeros(2, 5)
    logits[1] = float("-inf")
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
