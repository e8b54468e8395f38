"""Rollout-correction importance weights and their metrics."""

import math

import pytest
import torch

from rltune.algos import importance_weight_metrics, importance_weights

F64 = torch.float64
NAN = float("nan")


def _logs(rows):
    """log of each ratio; None marks a masked-out position (NaN log-prob there)."""
    lr = torch.tensor([[NAN if r is None else math.log(r) for r in row] for row in rows], dtype=F64)
    mask = torch.tensor([[r is not None for r in row] for row in rows], dtype=F64)
    behaviour = torch.full_like(lr, -2.0)
    return behaviour + lr, behaviour, mask


def test_token_truncate_hand_values():
    # ratios 0.5, 1.5, 3 with cap 2 -> 0.5, 1.5, 2; padding -> 0
    old, behaviour, mask = _logs([[0.5, 1.5, 3.0], [1.0, None, None]])
    w = importance_weights(old, behaviour, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0], [1.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12)
    # cap 1 (V-trace's rho_bar = 1) is allowed
    w1 = importance_weights(old, behaviour, mask, cap=1.0)
    torch.testing.assert_close(w1, torch.tensor([[0.5, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12)


def test_seq_mask_hand_values():
    # geometric means with cap 2 (kept when in [0.5, 2]):
    #  [3, 1]      -> sqrt(3)   = 1.732  kept
    #  [5, 1]      -> sqrt(5)   = 2.236  dropped
    #  [0.2, 1]    -> sqrt(0.2) = 0.447  dropped
    #  [0.6, pad]  -> 0.6                kept (its pad stays 0)
    #  [pad, pad]  -> empty, 0
    old, behaviour, mask = _logs([[3.0, 1.0], [5.0, 1.0], [0.2, 1.0], [0.6, None], [None, None]])
    w = importance_weights(old, behaviour, mask, mode="seq-mask", cap=2.0)
    expected = torch.tensor([[1, 1], [0, 0], [0, 0], [1, 0], [0, 0]], dtype=F64)
    torch.testing.assert_close(w, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["token-truncate", "seq-mask"])
def test_weights_match_loop_reference(mode):
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(9, 7, generator=g, dtype=F64) * 3
    # per-sequence drift so that seq-mask keeps some rows and drops others
    drift = 0.6 * torch.randn(9, 1, generator=g, dtype=F64)
    old = behaviour + drift + 0.3 * torch.randn(9, 7, generator=g, dtype=F64)
    mask = torch.rand(9, 7, generator=g) > 0.3
    mask[2] = False
    old[~mask] = NAN
    w = importance_weights(old, behaviour, mask, mode=mode, cap=1.5)
    expected = []
    for b in range(9):
        lrs = [old[b, t].item() - behaviour[b, t].item() for t in range(7) if mask[b, t]]
        if mode == "seq-mask":
            keep_row = bool(lrs) and 1 / 1.5 <= math.exp(sum(lrs) / len(lrs)) <= 1.5
        row = []
        for t in range(7):
            if not mask[b, t]:
                row.append(0.0)
            elif mode == "token-truncate":
                row.append(min(math.exp(old[b, t].item() - behaviour[b, t].item()), 1.5))
            else:
                row.append(1.0 if keep_row else 0.0)
        expected.append(row)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    if mode == "seq-mask":
        kept_rows = [any(r) for r in expected]
        assert 2 <= sum(kept_rows) <= 6, kept_rows


def test_weights_are_detached_and_finite_for_extreme_gaps():
    old = torch.tensor([[200.0, -200.0, 0.0]], requires_grad=True)
    behaviour = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = importance_weights(old, behaviour, mask, cap=3.0)
    assert not w.requires_grad
    # log-ratio clamped to +-20: min(exp(20), 3) = 3 and exp(-20)
    torch.testing.assert_close(w, torch.tensor([[3.0, math.exp(-20.0), 0.0]]), rtol=1e-6, atol=0)


def test_metrics_hand_values():
    # ratios [[0.5, 1.5, 3], [1, pad]] truncated at 2: weights [[0.5, 1.5, 2], [1, 0]]
    old, behaviour, mask = _logs([[0.5, 1.5, 3.0], [1.0, None, None]])
    w = importance_weights(old, behaviour, mask, cap=2.0)
    m = importance_weight_metrics(w, old, behaviour, mask)
    # |log ratio| mean: (log 2 + log 1.5 + log 3 + 0) / 4
    assert abs(m["is_abs_logp_diff"].item() - (math.log(2) + math.log(1.5) + math.log(3)) / 4) < 1e-12
    assert abs(m["is_weight_mean"].item() - 1.25) < 1e-12  # (0.5 + 1.5 + 2 + 1) / 4
    assert abs(m["is_weight_max"].item() - 2.0) < 1e-12
    assert abs(m["is_weight_min"].item() - 0.5) < 1e-12
    assert m["is_truncated_frac"].item() == 0.25  # the ratio-3 token
    assert m["is_masked_frac"].item() == 0.0
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    # seq-mask on [3, 1] (kept) and [5, 1] (dropped): half the tokens masked, min 0
    old, behaviour, mask = _logs([[3.0, 1.0], [5.0, 1.0]])
    w = importance_weights(old, behaviour, mask, mode="seq-mask", cap=2.0)
    m = importance_weight_metrics(w, old, behaviour, mask)
    assert m["is_masked_frac"].item() == 0.5 and m["is_weight_min"].item() == 0.0
    assert m["is_weight_mean"].item() == 0.5 and m["is_weight_max"].item() == 1.0


def test_metrics_of_empty_mask_are_zero():
    x = torch.full((2, 2), NAN)
    m = importance_weight_metrics(torch.zeros(2, 2), x, x, torch.zeros(2, 2))
    assert all(v.item() == 0.0 for v in m.values())


def test_errors_name_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="importance_weights: mode='tis'"):
        importance_weights(x, x, x, mode="tis")
    with pytest.raises(ValueError, match="cap=0.5 must be >= 1"):
        importance_weights(x, x, x, cap=0.5)
    with pytest.raises(ValueError, match="cap=1.0 must be > 1 for mode='seq-mask'"):
        importance_weights(x, x, x, mode="seq-mask", cap=1.0)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        importance_weights(x, torch.zeros(2, 2), x)
    with pytest.raises(ValueError, match="importance_weight_metrics: .*weights"):
        importance_weight_metrics(torch.zeros(1, 3), x, x, x)
