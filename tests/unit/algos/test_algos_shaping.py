"""Reward shaping: token placement, KL in the reward, DAPO's overlong penalty and
dynamic-sampling filter."""

import pytest
import torch

from rltune.algos import groups_with_spread, kl_shaped_rewards, last_token_rewards, overlong_penalty

F64 = torch.float64
NAN = float("nan")


def _f64(values):
    return torch.tensor(values, dtype=F64)


def test_last_token_rewards_hand_values():
    # row 0 ends at 1; row 1 is empty (its NaN score never appears); row 2 ends at 2 after
    # a gap; row 3 has a masked-in token only at 0
    scores = _f64([2.0, NAN, 5.0, -1.0])
    mask = _f64([[1, 1, 0], [0, 0, 0], [1, 0, 1], [1, 0, 0]])
    expected = _f64([[0, 2, 0], [0, 0, 0], [0, 0, 5], [-1, 0, 0]])
    torch.testing.assert_close(last_token_rewards(scores, mask), expected, rtol=0, atol=0)
    # a bool mask works the same
    torch.testing.assert_close(last_token_rewards(scores, mask.bool()), expected, rtol=0, atol=0)


def test_last_token_rewards_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(7, generator=g, dtype=F64)
    mask = torch.rand(7, 6, generator=g) > 0.5
    out = last_token_rewards(scores, mask)
    for b in range(7):
        kept = [t for t in range(6) if mask[b, t]]
        for t in range(6):
            expected = scores[b].item() if kept and t == kept[-1] else 0.0
            assert out[b, t].item() == expected


def test_kl_shaped_rewards_hand_values():
    # kl_coef 0.5: row 0: [-0.5*0.1, 1 - 0.5*0.2, pad] = [-0.05, 0.9, 0]
    #              row 1: [-0.5*0.3, -0.5*0.4, 2 - 0.5*0.5] = [-0.15, -0.2, 1.75]
    scores = _f64([1.0, 2.0])
    kl = _f64([[0.1, 0.2, NAN], [0.3, 0.4, 0.5]]).requires_grad_(True)
    mask = _f64([[1, 1, 0], [1, 1, 1]])
    out = kl_shaped_rewards(scores, kl, mask, kl_coef=0.5)
    torch.testing.assert_close(out, _f64([[-0.05, 0.9, 0.0], [-0.15, -0.2, 1.75]]), rtol=0, atol=1e-12)
    assert not out.requires_grad
    # kl_coef 0 is the plain sparse reward
    torch.testing.assert_close(kl_shaped_rewards(scores, kl, mask, kl_coef=0.0), last_token_rewards(scores, mask))


def test_kl_shaped_rewards_errors():
    with pytest.raises(ValueError, match="kl_shaped_rewards: kl_coef=-0.1"):
        kl_shaped_rewards(_f64([1.0]), _f64([[0.0]]), _f64([[1.0]]), kl_coef=-0.1)
    with pytest.raises(ValueError, match="kl has shape"):
        kl_shaped_rewards(_f64([1.0]), _f64([[0.0, 0.0]]), _f64([[1.0]]), kl_coef=0.1)
    with pytest.raises(ValueError, match="last_token_rewards"):
        last_token_rewards(_f64([1.0, 2.0]), _f64([[1.0]]))


def test_overlong_penalty_hand_values():
    # max_len 20, buffer 4: soft zone (16, 20]; -(L - 16) / 4 inside it, -1 beyond 20
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    out = overlong_penalty(lengths, max_len=20, buffer=4)
    assert out.dtype == torch.get_default_dtype()
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    half = overlong_penalty(lengths.to(F64), max_len=20, buffer=4, penalty=0.5)
    torch.testing.assert_close(half, 0.5 * expected.to(F64), rtol=0, atol=0)
    # buffer 0: only the step beyond max_len
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([19, 20, 21]), max_len=20, buffer=0, penalty=2.0),
        torch.tensor([0.0, 0.0, -2.0]), rtol=0, atol=0,
    )


def test_overlong_penalty_matches_loop_reference():
    lengths = torch.arange(0, 40, dtype=F64) + 0.5
    out = overlong_penalty(lengths, max_len=30, buffer=7, penalty=0.8)
    for L, value in zip(lengths.tolist(), out.tolist()):
        if L <= 23:
            expected = 0.0
        elif L <= 30:
            expected = 0.8 * (23 - L) / 7
        else:
            expected = -0.8
        assert abs(value - expected) < 1e-12, L


def test_overlong_penalty_errors():
    lengths = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="overlong_penalty: buffer=30"):
        overlong_penalty(lengths, max_len=20, buffer=30)
    with pytest.raises(ValueError, match="max_len=0"):
        overlong_penalty(lengths, max_len=0, buffer=0)
    with pytest.raises(ValueError, match="penalty=-1"):
        overlong_penalty(lengths, max_len=20, buffer=4, penalty=-1.0)


def test_groups_with_spread_hand_values():
    rewards = _f64([1, 1, 1, 1, 2, 1, 3, NAN, NAN, 0, 0, 5, NAN, NAN, NAN])
    valid = torch.tensor([True] * 7 + [False, False, True, True, False, False, False, False])
    # all equal -> False; 1, 2, 1 -> True; one valid row -> False; valid 0, 0 (the 5 is
    # invalid) -> False; no valid row -> False
    out = groups_with_spread(rewards, 3, valid=valid)
    assert out.tolist() == [False, True, False, False, False]
    assert groups_with_spread(_f64([1.0, 2.0, 3.0]), 1).tolist() == [False, False, False]


def test_groups_with_spread_matches_loop_reference():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (40,), generator=g).to(F64)  # binary: many all-equal groups
    valid = torch.rand(40, generator=g) > 0.2
    rewards[~valid] = NAN
    out = groups_with_spread(rewards, 4, valid=valid)
    expected = []
    for start in range(0, 40, 4):
        vals = [rewards[i].item() for i in range(start, start + 4) if valid[i]]
        expected.append(len(vals) >= 2 and len(set(vals)) > 1)
    assert out.tolist() == expected and any(expected) and not all(expected)
    with pytest.raises(ValueError, match="groups_with_spread: .*group_size=3"):
        groups_with_spread(rewards, 3)
