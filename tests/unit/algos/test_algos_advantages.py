"""Critic-free advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++) against values worked out
by hand and loop references."""

import math

import pytest
import torch

from rltune.algos import (
    group_advantages,
    group_baseline,
    last_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)

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


# ---------------------------------------------------------------- RLOO and group baseline

def test_rloo_hand_values():
    # group of 4, sum 2: A_i = r_i - (2 - r_i) / 3 -> 1 - 1/3 = 2/3 and 0 - 2/3 = -2/3
    adv = rloo_advantages(_f64([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(adv, _f64([2 / 3, -2 / 3, -2 / 3, 2 / 3]), rtol=0, atol=1e-12)
    # two groups of 3: [1, 2, 6] -> 1 - 4, 2 - 3.5, 6 - 1.5; [5, 5, 5] -> 0
    adv = rloo_advantages(_f64([1.0, 2.0, 6.0, 5.0, 5.0, 5.0]), 3)
    torch.testing.assert_close(adv, _f64([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0]), rtol=0, atol=1e-12)


def test_rloo_invalid_rows_and_small_groups():
    # valid 1, 0, 4 (sum 5, n 3): 1 - 4/2 = -1, 0 - 5/2 = -2.5, 4 - 1/2 = 3.5; NaN row -> 0
    rewards = _f64([1.0, NAN, 0.0, 4.0, 7.0, NAN, NAN, NAN])
    valid = torch.tensor([True, False, True, True, True, False, False, False])
    adv = rloo_advantages(rewards, 4, valid=valid)
    # second group: one valid row (no other sample to compare with) -> all 0
    torch.testing.assert_close(adv, _f64([-1.0, 0.0, -2.5, 3.5, 0.0, 0.0, 0.0, 0.0]), rtol=0, atol=1e-12)
    assert torch.equal(rloo_advantages(_f64([3.0, -1.0]), 1), torch.zeros(2, dtype=torch.float64))


def test_rloo_matches_loop_reference_and_scaled_dr_grpo():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(30, generator=g, dtype=torch.float64)
    valid = torch.rand(30, generator=g) > 0.3
    rewards[~valid] = NAN
    adv = rloo_advantages(rewards, 5, valid=valid)
    expected = []
    for start in range(0, 30, 5):
        rows = [i for i in range(start, start + 5) if valid[i]]
        for i in range(start, start + 5):
            others = [rewards[j].item() for j in rows if j != i]
            ok = valid[i] and len(rows) >= 2
            expected.append(rewards[i].item() - sum(others) / len(others) if ok else 0.0)
    torch.testing.assert_close(adv, _f64(expected), rtol=0, atol=1e-12)
    # RLOO = n / (n - 1) * (r - mean): full groups of 5 against Dr. GRPO's advantage
    full = torch.randn(10, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        rloo_advantages(full, 5), 1.25 * group_advantages(full, 5, scale="none"), rtol=0, atol=1e-12
    )


def test_group_baseline_hand_values():
    # means 2 and 5; the third group's one valid row gets r - r = 0; NaN never leaks
    rewards = _f64([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 4.0, NAN, NAN])
    valid = torch.tensor([True] * 7 + [False, False])
    out = group_baseline(rewards, 3, valid=valid)
    torch.testing.assert_close(out, _f64([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fn", [rloo_advantages, group_baseline])
def test_rloo_and_baseline_errors_name_the_function(fn):
    with pytest.raises(ValueError, match=f"{fn.__name__}: .*group_size=3"):
        fn(_f64([1.0, 2.0, 3.0, 4.0]), 3)
    with pytest.raises(ValueError, match=f"{fn.__name__}: valid"):
        fn(_f64([1.0, 2.0]), 2, valid=torch.tensor([True]))
    with pytest.raises(ValueError, match="1-D"):
        fn(torch.zeros(2, 2, dtype=torch.float64), 2)


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_values():
    # gamma 0.5. Row 0: rewards [0, 0, 1] -> G = [0.25, 0.5, 1]. Row 1: [0, -1, pad] ->
    # G = [-0.5, -1]. Over the 5 tokens: mean 0.25 / 5 = 0.05; deviations
    # [0.2, 0.45, 0.95, -0.55, -1.05]; squares sum 0.04 + 0.2025 + 0.9025 + 0.3025 + 1.1025
    # = 2.55, population variance 0.51; A = deviation / sqrt(0.51 + 1e-8)
    rewards = _f64([[0.0, 0.0, 1.0], [0.0, -1.0, NAN]])
    mask = _f64([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    s = math.sqrt(0.51 + 1e-8)
    expected = _f64([[0.2 / s, 0.45 / s, 0.95 / s], [-0.55 / s, -1.05 / s, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_skips_masked_gap():
    # tokens at 0 and 2 (1 is a tool token): G = [0 + 0.5 * 1, -, 1] = [0.5, 0, 1];
    # mean 0.75, variance 0.0625, so A = [-0.25, 0, 0.25] / sqrt(0.0625 + 1e-8)
    adv = reinforce_pp_advantages(_f64([[0.0, 100.0, 1.0]]), _f64([[1, 0, 1]]), gamma=0.5)
    a = 0.25 / math.sqrt(0.0625 + 1e-8)
    torch.testing.assert_close(adv, _f64([[-a, 0.0, a]]), rtol=0, atol=1e-12)


def _ref_reinforce_pp(rewards, mask, gamma):
    returns = [[0.0] * len(row) for row in rewards]
    kept_values = []
    for b, row in enumerate(rewards):
        g = 0.0
        for t in reversed(range(len(row))):
            if mask[b][t]:
                g = row[t] + gamma * g
                returns[b][t] = g
                kept_values.append(g)
    mean = sum(kept_values) / len(kept_values)
    var = sum((x - mean) ** 2 for x in kept_values) / len(kept_values)
    return [
        [(returns[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0 for t in range(len(rewards[b]))]
        for b in range(len(rewards))
    ]


def test_reinforce_pp_matches_loop_reference():
    g = torch.Generator().manual_seed(6)
    rewards = torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 9, generator=g) > 0.3
    mask[4] = False
    rewards[~mask] = NAN
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    expected = _ref_reinforce_pp(rewards.tolist(), mask.tolist(), 0.9)
    torch.testing.assert_close(adv, _f64(expected), rtol=0, atol=1e-10)
    kept = adv[mask]
    assert abs(kept.mean().item()) < 1e-12 and abs(kept.var(unbiased=False).item() - 1.0) < 1e-6


def test_reinforce_pp_with_group_baseline_pipeline():
    # scores 1, 0 | 3, 3 -> baselines 0.5, -0.5 | 0, 0 on each last token; gamma 1 gives
    # every token its sequence's baseline. Tokens: row 0 (2 tokens) 0.5, row 1 (1 token)
    # -0.5, rows 2, 3 (3 tokens, 1 token) 0: mean (1 - 0.5) / 7 = 1/14.
    scores = _f64([1.0, 0.0, 3.0, 3.0])
    mask = _f64([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 1]])
    adv = reinforce_pp_advantages(last_token_rewards(group_baseline(scores, 2), mask), mask)
    values = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    mean = sum(values) / 7
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 7 + 1e-8)
    a, b, c = (0.5 - mean) / std, (-0.5 - mean) / std, -mean / std
    expected = _f64([[a, a, 0.0], [b, 0.0, 0.0], [c, c, c], [0.0, 0.0, c]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_reinforce_pp_empty_mask_no_grad_and_errors():
    r = torch.randn(2, 3, requires_grad=True)
    out = reinforce_pp_advantages(r, torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3)) and not out.requires_grad
    with pytest.raises(ValueError, match="reinforce_pp_advantages: gamma=1.1"):
        reinforce_pp_advantages(r, torch.ones(2, 3), gamma=1.1)
    with pytest.raises(ValueError, match="token_rewards"):
        reinforce_pp_advantages(r, torch.ones(2, 4))
