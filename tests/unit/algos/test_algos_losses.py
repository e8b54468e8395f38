"""Policy losses: hand values, a loop re-implementation, micro-batch invariance."""

import math

import pytest
import torch

from rltune.algos import (
    AGGREGATIONS,
    aggregate_loss,
    loss_denominator,
    ppo_policy_loss,
    sft_loss,
)
from rltune.metrics.types import Max, scalars

F64 = torch.float64
MAX_LEN = 12  # the constant length of "seq-mean-token-sum-norm" in these tests (T = 9)


def _agg_kwargs(agg):
    """The extra argument an aggregation needs: max_len for the Dr. GRPO mode only."""
    return {"max_len": MAX_LEN} if AGGREGATIONS[agg].per_max_len else {}


# ---------------------------------------------------------------- loop reference (floats)


def _ref_token(lp, old, a, *, cl, ch, dual):
    """One token of the clipped surrogate in plain floats; returns (loss, clipped, capped)."""
    r = math.exp(lp - old)
    unclipped = -a * r
    clipped = -a * min(max(r, 1.0 - cl), 1.0 + ch)
    loss = max(unclipped, clipped)
    capped = dual is not None and a < 0 and -dual * a < loss
    return (-dual * a if capped else loss), clipped > unclipped, capped


def _ref_ppo(lp, old, adv, mask, *, cl, ch, dual, agg, w=None, den=None, max_len=None):
    """Independent ppo_policy_loss on nested lists of floats (fp64)."""
    seq_sums, seq_counts, stats = [], [], {"clip": 0.0, "kl": 0.0, "ratio": 0.0, "max": 0.0, "n": 0.0}
    for b in range(len(lp)):
        s = c = 0.0
        for t in range(len(lp[b])):
            m = mask[b][t]
            if m == 0:
                continue
            loss, clipped, _ = _ref_token(lp[b][t], old[b][t], adv[b][t], cl=cl, ch=ch, dual=dual)
            loss *= 1.0 if w is None else w[b][t]
            s += loss * m
            c += m
            r = math.exp(lp[b][t] - old[b][t])
            stats["clip"] += m * clipped
            stats["kl"] += m * (r - 1.0 - math.log(r))
            stats["ratio"] += m * r
            stats["max"] = max(stats["max"], r)
            stats["n"] += m
        seq_sums.append(s)
        seq_counts.append(c)
    nonempty = [i for i, c in enumerate(seq_counts) if c > 0]
    if agg == "token-mean":
        num, own = sum(seq_sums), sum(seq_counts)
    elif agg == "seq-mean-token-mean":
        num, own = sum(seq_sums[i] / seq_counts[i] for i in nonempty), len(nonempty)
    elif agg == "seq-mean-token-sum":
        num, own = sum(seq_sums[i] for i in nonempty), len(nonempty)
    else:
        assert agg == "seq-mean-token-sum-norm"
        num, own = sum(seq_sums[i] for i in nonempty), len(nonempty) * max_len
    d = own if den is None else den
    n = stats["n"]
    metrics = {
        "clip_frac": stats["clip"] / n,
        "approx_kl": stats["kl"] / n,
        "ratio_mean": stats["ratio"] / n,
        "ratio_max": stats["max"],
    }
    return (num / d if d else 0.0), metrics


def _random_batch(seed, B=8, T=9, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3.0
    # spread of 0.8 in log space: ratios from ~0.1 to ~10, so both clip sides and the dual
    # clip are exercised
    lp = old + 0.8 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    mask[2] = 0.0  # a sequence with nothing to learn from
    mask[5, 4:] = 0.0  # a shorter sequence
    w = 0.5 + torch.rand(B, T, generator=g, dtype=dtype)
    return lp, old, adv, mask, w


def _lists(*tensors):
    return [t.tolist() for t in tensors]


# ---------------------------------------------------------------- hand values


def _hand_tokens():
    # ratios r and advantages A, clip 0.2 on both sides:
    #  a: A=+1, r=exp(0.1)=1.105171 inside the band    -> -1.105171, gradient -A*r = -1.105171
    #  b: A=+1, r=1.5 above 1.2, clipped and worse     -> -1.2,      gradient 0
    #  c: A=-1, r=0.5 below 0.8, clipped and worse     -> +0.8,      gradient 0
    #  d: A=-1, r=1.5: max(1.5, 1.2) unclipped         -> +1.5,      gradient +1.5
    #  e: A=+1, r=0.5: max(-0.5, -0.8) unclipped       -> -0.5,      gradient -0.5
    ratios = torch.tensor([[math.exp(0.1), 1.5, 0.5, 1.5, 0.5]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=F64)
    return ratios.log(), torch.zeros(1, 5, dtype=F64), adv, torch.ones(1, 5, dtype=F64)


def test_ppo_hand_values_and_clip_gradient():
    lp, old, adv, mask = _hand_tokens()
    lp.requires_grad_(True)
    loss, metrics = ppo_policy_loss(lp, old, adv, mask)
    # (-1.105171 - 1.2 + 0.8 + 1.5 - 0.5) / 5 = -0.1010342
    expected = (-math.exp(0.1) - 1.2 + 0.8 + 1.5 - 0.5) / 5.0
    assert abs(expected - (-0.1010342)) < 1e-7
    assert abs(loss.item() - expected) < 1e-12
    loss.backward()
    grad = torch.tensor([[-math.exp(0.1), 0.0, 0.0, 1.5, -0.5]], dtype=F64) / 5.0
    torch.testing.assert_close(lp.grad, grad, rtol=0, atol=1e-12)
    assert abs(metrics["clip_frac"].item() - 0.4) < 1e-12  # tokens b and c
    assert abs(metrics["ratio_max"].value.item() - 1.5) < 1e-12
    # ratio mean (1.105171 + 1.5 + 0.5 + 1.5 + 0.5) / 5
    assert abs(metrics["ratio_mean"].item() - (math.exp(0.1) + 4.0) / 5.0) < 1e-12


def test_dual_clip_caps_negative_advantage_hand_value():
    # A=-1, r=4: the clipped surrogate gives max(4, 1.2) = 4; dual clip c=3 caps it at 3,
    # with zero gradient. A second token A=-1, r=2 stays at 2 (below the cap).
    lp = torch.tensor([[math.log(4.0), math.log(2.0)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)  # [B] broadcast over tokens
    mask = torch.ones(1, 2, dtype=F64)
    loss, metrics = ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert abs(loss.item() - (3.0 + 2.0) / 2.0) < 1e-12
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 1.0]], dtype=F64), rtol=0, atol=1e-12)
    assert metrics["dual_clip_frac"].item() == 0.5
    no_dual, _ = ppo_policy_loss(lp, old, adv, mask)
    assert abs(no_dual.item() - 3.0) < 1e-12  # (4 + 2) / 2


def test_aggregation_hand_values():
    # ratio 1 everywhere, so the per-token loss is -A
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    lp = torch.zeros(3, 3, dtype=F64)
    cases = {
        "token-mean": -(1.0 + 2.0 + 4.0) / 3.0,  # 3 tokens
        "seq-mean-token-mean": -(1.5 + 4.0) / 2.0,  # 2 non-empty sequences
        "seq-mean-token-sum": -(3.0 + 4.0) / 2.0,
    }
    for agg, expected in cases.items():
        loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation=agg)
        assert abs(loss.item() - expected) < 1e-12, agg
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation="token-mean", denominator=10.0)
    assert abs(loss.item() - (-0.7)) < 1e-12
    assert loss_denominator(mask, aggregation="token-mean").item() == 3.0
    assert loss_denominator(mask, aggregation="seq-mean-token-sum").item() == 2.0


# ---------------------------------------------------------------- independent reference


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("dual", [None, 2.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_matches_loop_reference(agg, dual, weighted):
    lp, old, adv, mask, w = _random_batch(seed=1)
    w = w if weighted else None
    loss, metrics = ppo_policy_loss(
        lp, old, adv, mask,
        clip_low=0.2, clip_high=0.28, dual_clip=dual, aggregation=agg, is_weights=w,
        **_agg_kwargs(agg),
    )
    ref_loss, ref_metrics = _ref_ppo(
        *_lists(lp, old, adv, mask),
        cl=0.2, ch=0.28, dual=dual, agg=agg, w=None if w is None else w.tolist(),
        max_len=MAX_LEN,
    )
    assert abs(loss.item() - ref_loss) < 1e-6
    assert isinstance(metrics["ratio_max"], Max)  # the others are means
    for name, value in ref_metrics.items():
        got = metrics[name].value if name == "ratio_max" else metrics[name]
        assert abs(got.item() - value) < 1e-6, name
        assert got.dim() == 0 and not got.requires_grad


def test_random_batch_exercises_both_clip_sides_and_dual_clip():
    lp, old, adv, mask, _ = _random_batch(seed=1)
    hits = {"low": 0, "high": 0, "dual": 0}
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t] == 0:
                continue
            r, a = math.exp(lp[b, t].item() - old[b, t].item()), adv[b, t].item()
            hits["high"] += a > 0 and r > 1.28
            hits["low"] += a < 0 and r < 0.8
            hits["dual"] += a < 0 and r > 2.0
    assert min(hits.values()) >= 2, hits


def test_ppo_fp32_matches_fp64_reference():
    lp, old, adv, mask, _ = _random_batch(seed=2, dtype=torch.float32)
    loss, _ = ppo_policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-mean")
    ref, _ = _ref_ppo(
        *_lists(lp.double(), old.double(), adv.double(), mask),
        cl=0.2, ch=0.2, dual=None, agg="seq-mean-token-mean",
    )
    assert abs(loss.item() - ref) < 1e-5


# ---------------------------------------------------------------- micro-batching


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_micro_batch_losses_and_grads_sum_to_full_batch(agg, chunks):
    lp, old, adv, mask, w = _random_batch(seed=4)
    full_lp = lp.clone().requires_grad_(True)
    kw = _agg_kwargs(agg)
    full, _ = ppo_policy_loss(full_lp, old, adv, mask, aggregation=agg, dual_clip=2.0, is_weights=w, **kw)
    full.backward()
    den = loss_denominator(mask, aggregation=agg, **kw)
    micro_lp = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows in torch.arange(lp.shape[0]).chunk(chunks):
        part, _ = ppo_policy_loss(
            micro_lp[rows], old[rows], adv[rows], mask[rows],
            aggregation=agg, dual_clip=2.0, is_weights=w[rows], denominator=den,
        )
        total = total + part
    total.backward()
    assert abs(total.item() - full.item()) < 1e-6
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=0, atol=1e-6)


def test_micro_batch_sft_sums_to_full_batch():
    lp, _, _, mask, _ = _random_batch(seed=5)
    full, _ = sft_loss(lp, mask)
    den = float(loss_denominator(mask))
    parts = [sft_loss(lp[r], mask[r], denominator=den)[0] for r in torch.arange(8).chunk(4)]
    assert abs(sum(p.item() for p in parts) - full.item()) < 1e-6


# ---------------------------------------------------------------- edge cases and errors


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_empty_mask_gives_zero_loss_and_finite_grads_with_inf_padding(agg):
    lp = torch.full((2, 3), -float("inf"), requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([float("nan"), 1.0])
    loss, metrics = ppo_policy_loss(
        lp, old, adv, torch.zeros(2, 3), aggregation=agg, dual_clip=3.0, **_agg_kwargs(agg)
    )
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3))
    assert all(v == 0.0 for v in scalars(metrics).values())
    sft, sft_metrics = sft_loss(torch.full((2, 3), -float("inf")), torch.zeros(2, 3))
    assert sft.item() == 0.0 and sft_metrics["nll"].item() == 0.0


def test_padding_with_inf_logprobs_does_not_poison_loss_or_grad():
    lp = torch.tensor([[-0.5, -float("inf")]], requires_grad=True)
    old = torch.tensor([[-0.5, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, metrics = ppo_policy_loss(lp, old, torch.tensor([2.0]), mask)
    assert loss.item() == -2.0  # ratio 1, -A on the one real token
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, 0.0]]), rtol=0, atol=0)
    assert metrics["approx_kl"].item() == 0.0


def test_sequence_advantage_broadcasts_like_token_advantage():
    lp, old, _, mask, _ = _random_batch(seed=6)
    seq_adv = torch.randn(8, dtype=F64)
    a, _ = ppo_policy_loss(lp, old, seq_adv, mask)
    b, _ = ppo_policy_loss(lp, old, seq_adv[:, None].expand(8, 9), mask)
    assert abs(a.item() - b.item()) < 1e-12


def test_is_weights_are_detached():
    lp, old, adv, mask, w = _random_batch(seed=7)
    w.requires_grad_(True)
    lp.requires_grad_(True)
    loss, _ = ppo_policy_loss(lp, old, adv, mask, is_weights=w)
    loss.backward()
    assert w.grad is None and lp.grad is not None


def test_sft_hand_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = sft_loss(lp, mask)
    assert abs(loss.item() - 7.0 / 3.0) < 1e-6  # (1 + 2 + 4) / 3
    assert abs(metrics["nll"].item() - 7.0 / 3.0) < 1e-6 and metrics["num_tokens"].value.item() == 3.0
    loss.backward()
    torch.testing.assert_close(lp.grad, -mask / 3.0, rtol=0, atol=1e-7)
    half, _ = sft_loss(lp, mask, denominator=7.0)
    assert abs(half.item() - 1.0) < 1e-6


def test_errors_name_the_argument():
    lp, old, adv, mask, _ = _random_batch(seed=8)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(lp, old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="aggregation='seq-sum'"):
        ppo_policy_loss(lp, old, adv, mask, aggregation="seq-sum")
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_policy_loss(lp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="denominator"):
        ppo_policy_loss(lp, old, adv, mask, denominator=-1.0)
    with pytest.raises(ValueError, match="aggregation"):
        loss_denominator(mask, aggregation="nope")


def test_aggregate_loss_matches_hand_values_for_each_mode():
    from rltune.algos import aggregate_loss

    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    # token-mean: (1 + 2 + 4) / 3
    assert aggregate_loss(x, m).item() == pytest.approx(7 / 3, abs=1e-12)
    # seq-mean-token-mean: ((1 + 2) / 2 + 4 / 1) / 2 = 2.75
    assert aggregate_loss(x, m, aggregation="seq-mean-token-mean").item() == pytest.approx(2.75, abs=1e-12)
    # seq-mean-token-sum: (3 + 4) / 2 = 3.5, or / 7 with an explicit whole-batch denominator
    assert aggregate_loss(x, m, aggregation="seq-mean-token-sum").item() == pytest.approx(3.5, abs=1e-12)
    assert aggregate_loss(x, m, aggregation="seq-mean-token-sum", denominator=7.0).item() == pytest.approx(1.0)


# ---------------------------------------------------------------- Dr. GRPO aggregation


def test_seq_mean_token_sum_norm_hand_values():
    # ratio 1, so the per-token loss is -A; token sums -(1 + 2) = -3 and -4, an empty third
    # row; 2 non-empty sequences x max_len 5 = 10, so the loss is -7 / 10
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    lp = torch.zeros(3, 3, dtype=F64)
    agg = "seq-mean-token-sum-norm"
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation=agg, max_len=5)
    assert abs(loss.item() - (-0.7)) < 1e-12
    assert loss_denominator(mask, aggregation=agg, max_len=5).item() == 10.0
    assert abs(aggregate_loss(-adv, mask, aggregation=agg, max_len=5).item() - (-0.7)) < 1e-12
    # an explicit denominator replaces the count, so max_len is not needed: -7 / 14
    loss, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation=agg, denominator=14.0)
    assert abs(loss.item() - (-0.5)) < 1e-12


def test_seq_mean_token_sum_norm_does_not_depend_on_padding_width():
    # the same tokens padded to T=3 or T=6 give the same loss (the constant is max_len, not T)
    adv = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    wide_adv = torch.cat([adv, torch.zeros(1, 3, dtype=F64)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(1, 3, dtype=F64)], dim=1)
    agg = "seq-mean-token-sum-norm"
    lp, wide_lp = torch.zeros(1, 3, dtype=F64), torch.zeros(1, 6, dtype=F64)
    a, _ = ppo_policy_loss(lp, lp, adv, mask, aggregation=agg, max_len=8)
    b, _ = ppo_policy_loss(wide_lp, wide_lp, wide_adv, wide_mask, aggregation=agg, max_len=8)
    assert abs(a.item() - (-3.0 / 8.0)) < 1e-12 and abs(b.item() - a.item()) < 1e-12


def test_max_len_is_required_by_the_norm_mode_only():
    lp, old, adv, mask, _ = _random_batch(seed=9)
    with pytest.raises(ValueError, match="ppo_policy_loss: aggregation='seq-mean-token-sum-norm'.*max_len"):
        ppo_policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_denominator: .*max_len=None"):
        loss_denominator(mask, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="max_len=0"):
        loss_denominator(mask, aggregation="seq-mean-token-sum-norm", max_len=0)
    # the other modes ignore max_len
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        a, _ = ppo_policy_loss(lp, old, adv, mask, aggregation=agg)
        b, _ = ppo_policy_loss(lp, old, adv, mask, aggregation=agg, max_len=MAX_LEN)
        assert a.item() == b.item()
        with_len = loss_denominator(mask, aggregation=agg, max_len=MAX_LEN)
        assert with_len.item() == loss_denominator(mask, aggregation=agg).item()
