"""Masked reductions against values worked out by hand."""

import math

import torch

from rltune.algos import masked_mean, masked_sum, masked_whiten


def test_masked_mean_and_sum_ignore_masked_entries_even_nan():
    x = torch.tensor([1.0, 2.0, 3.0, float("nan")], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    # (1 + 2) / 2
    assert masked_mean(x, mask).item() == 1.5
    assert masked_sum(x, mask).item() == 3.0


def test_masked_mean_bool_mask_and_fractional_weights():
    x = torch.tensor([2.0, 4.0, 8.0], dtype=torch.float64)
    assert masked_mean(x, torch.tensor([True, False, True])).item() == 5.0
    # weights 0.5, 1, 0: (0.5*2 + 4) / 1.5 = 10/3
    w = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    assert abs(masked_mean(x, w).item() - 10.0 / 3.0) < 1e-12


def test_masked_reductions_along_dim_with_empty_row():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    # row 0: (1 + 3) / 2 = 2; row 1 has nothing masked in -> 0, not NaN
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 0.0]), rtol=0, atol=0)
    torch.testing.assert_close(masked_sum(x, mask, dim=-1), torch.tensor([4.0, 0.0]), rtol=0, atol=0)


def test_empty_mask_gives_zero_and_finite_gradient():
    x = torch.tensor([1.0, float("inf"), -3.0], requires_grad=True)
    mask = torch.zeros(3)
    out = masked_mean(x, mask)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros(3))


def test_masked_mean_gradient_is_zero_on_masked_nan_entries():
    x = torch.tensor([1.0, float("nan"), 3.0], requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0])
    masked_mean(x, mask).backward()
    # d/dx_i of (x0 + x2)/2 = 0.5 on kept entries, 0 on the masked one
    torch.testing.assert_close(x.grad, torch.tensor([0.5, 0.0, 0.5]), rtol=0, atol=0)


def test_masked_whiten_population_variance_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    # mean 2, population var ((1)^2 + 0 + (1)^2) / 3 = 2/3, std = 0.816497
    s = math.sqrt(2.0 / 3.0)
    expected = torch.tensor([-1.0 / s, 0.0, 1.0 / s, 0.0], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(x, mask, eps=0.0), expected, rtol=0, atol=1e-12)
    # the default eps=1e-8 moves the values by ~1e-8 relative
    torch.testing.assert_close(masked_whiten(x, mask), expected, rtol=0, atol=1e-7)
    # shift_mean=False keeps the mean: (x - 2)/s + 2 on kept entries, 0 elsewhere
    kept = torch.tensor([2.0 - 1.0 / s, 2.0, 2.0 + 1.0 / s, 0.0], dtype=torch.float64)
    unshifted = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(unshifted, kept, rtol=0, atol=1e-12)


def test_masked_whiten_empty_mask_is_zero():
    x = torch.tensor([1.0, float("nan")])
    out = masked_whiten(x, torch.zeros(2))
    assert torch.equal(out, torch.zeros(2))
