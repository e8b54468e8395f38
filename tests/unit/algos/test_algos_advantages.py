"""Group-relative advantages against values worked out by hand."""

import math

import pytest
import torch

from rltune.algos import group_advantages

NAN = float("nan")


def _f64(values):
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_hand_values_sample_std():
    # mean 0.5; sample var = 4 * 0.25 / (4 - 1) = 1/3, std = 0.57735...; 0.5 / 0.57735 = 0.866025...
    adv = group_advantages(_f64([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    a = 0.5 / math.sqrt(1.0 / 3.0)
    assert abs(a - 0.8660254) < 1e-7
    torch.testing.assert_close(adv, _f64([a, -a, -a, a]), rtol=0, atol=1e-12)
    # with the default eps=1e-6 added to the std
    b = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    adv = group_advantages(_f64([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(adv, _f64([b, -b, -b, b]), rtol=0, atol=1e-12)


def test_two_groups_and_all_equal_group_is_zero():
    # group 1: mean 2, sample std sqrt((1 + 0 + 1) / 2) = 1; group 2: all equal -> 0, no NaN
    adv = group_advantages(_f64([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3, eps=1e-6)
    d = 1.0 / (1.0 + 1e-6)
    torch.testing.assert_close(adv, _f64([-d, 0.0, d, 0.0, 0.0, 0.0]), rtol=0, atol=1e-12)


def test_scale_none_is_mean_centred_only():
    # Dr. GRPO: means 2 and 30
    adv = group_advantages(_f64([1.0, 2.0, 3.0, 10.0, 20.0, 60.0]), 3, scale="none")
    torch.testing.assert_close(adv, _f64([-1.0, 0.0, 1.0, -20.0, -10.0, 30.0]), rtol=0, atol=1e-12)


def test_length_one_groups_get_zero():
    for scale in ("std", "none"):
        adv = group_advantages(_f64([3.0, -1.0, 7.0]), 1, scale=scale)
        assert torch.equal(adv, torch.zeros(3, dtype=torch.float64))


def test_invalid_rows_are_excluded_from_baseline():
    rewards = _f64([1.0, NAN, 0.0, 4.0])
    valid = torch.tensor([True, False, True, True])
    # valid rewards 1, 0, 4: mean 5/3; deviations -2/3, -5/3, 7/3;
    # squares 4/9 + 25/9 + 49/9 = 78/9; sample var = (78/9) / 2 = 13/3; std = 2.0816660
    std = math.sqrt(13.0 / 3.0)
    expected = _f64([(-2.0 / 3.0) / std, 0.0, (-5.0 / 3.0) / std, (7.0 / 3.0) / std])
    assert abs(expected[3].item() - 1.1208971) < 1e-6
    adv = group_advantages(rewards, 4, eps=0.0, valid=valid)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    none = group_advantages(rewards, 4, scale="none", valid=valid)
    torch.testing.assert_close(none, _f64([-2.0 / 3.0, 0.0, -5.0 / 3.0, 7.0 / 3.0]), rtol=0, atol=1e-12)


def test_invalid_rows_never_leak_nan():
    # group 1: one valid row -> all 0; group 2: no valid row -> all 0; group 3: normal
    rewards = _f64([5.0, NAN, NAN, NAN, 0.0, 2.0])
    valid = torch.tensor([True, False, False, False, True, True])
    adv = group_advantages(rewards, 2, eps=0.0, valid=valid)
    # group 3: mean 1, sample std sqrt(2) -> -1/sqrt(2), 1/sqrt(2)
    r = 1.0 / math.sqrt(2.0)
    torch.testing.assert_close(adv, _f64([0.0, 0.0, 0.0, 0.0, -r, r]), rtol=0, atol=1e-12)


def test_matches_loop_reference_on_random_groups():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(24, generator=g, dtype=torch.float64)
    valid = torch.rand(24, generator=g) > 0.25
    rewards[~valid] = NAN
    adv = group_advantages(rewards, 6, eps=1e-6, valid=valid)
    expected = []
    for start in range(0, 24, 6):
        rows = range(start, start + 6)
        vals = [rewards[i].item() for i in rows if valid[i]]
        n = len(vals)
        mean = sum(vals) / n if n else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        for i in rows:
            expected.append((rewards[i].item() - mean) / (std + 1e-6) if valid[i] and n > 1 else 0.0)
    torch.testing.assert_close(adv, _f64(expected), rtol=0, atol=1e-6)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(_f64([1.0, 2.0, 3.0, 4.0]), 3)
    with pytest.raises(ValueError, match="scale='mad'"):
        group_advantages(_f64([1.0, 2.0]), 2, scale="mad")
    with pytest.raises(ValueError, match="valid"):
        group_advantages(_f64([1.0, 2.0]), 2, valid=torch.tensor([True]))


def test_all_equal_group_is_zero_even_without_eps():
    adv = group_advantages(_f64([2.0, 2.0, 2.0, 2.0]), 4, eps=0.0)
    assert torch.equal(adv, torch.zeros(4, dtype=torch.float64))
