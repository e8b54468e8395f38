"""GSPO: hand values, a loop reference for the loss and its analytic gradient, the
GSPO-token form, micro-batching."""

import math

import pytest
import torch

from rltune.algos import gspo_policy_loss, loss_denominator
from rltune.metrics.types import scalars

F64 = torch.float64
NAN = float("nan")


def _hand_batch():
    # log ratios per sequence (old log-probs -1):
    #  0: [1e-4, -1e-4, 3e-4], mean 1e-4, s = exp(1e-4) inside [1 - 3e-4, 1 + 4e-4]; A = 2
    #  1: [1e-3, 1e-3, pad], s = exp(1e-3) > 1.0004, A = +1: clipped, loss -1.0004
    #  2: empty (NaN advantage, -inf log-prob)
    #  3: [-1e-3, gap, -1e-3], s = exp(-1e-3) < 0.9997, A = -1: clipped, loss +0.9997
    log_ratio = torch.tensor(
        [[1e-4, -1e-4, 3e-4], [1e-3, 1e-3, 0.0], [0.0, 0.0, 0.0], [-1e-3, 0.0, -1e-3]], dtype=F64
    )
    old = torch.full((4, 3), -1.0, dtype=F64)
    lp = old + log_ratio
    lp[2, 0] = -float("inf")
    lp[3, 1] = float("inf")
    adv = torch.tensor([2.0, 1.0, NAN, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=F64)
    return lp, old, adv, mask, log_ratio


def test_gspo_hand_values_and_gradient():
    lp, old, adv, mask, log_ratio = _hand_batch()
    lp.requires_grad_(True)
    loss, metrics = gspo_policy_loss(lp, old, adv, mask)
    s0 = math.exp(1e-4)
    # 3 non-empty sequences: (-2 s0 - 1.0004 + 0.9997) / 3
    assert abs(loss.item() - (-2 * s0 - 1.0004 + 0.9997) / 3) < 1e-12
    loss.backward()
    # only sequence 0 is unclipped: d/dlp = -A s0 / n_0 / 3 = -2 s0 / 9 on its 3 tokens
    grad = torch.zeros(4, 3, dtype=F64)
    grad[0] = -2 * s0 / 9
    torch.testing.assert_close(lp.grad, grad, rtol=0, atol=1e-12)
    assert abs(metrics["clip_frac"].item() - 2 / 3) < 1e-12
    ratios = [s0, math.exp(1e-3), math.exp(-1e-3)]
    assert abs(metrics["ratio_mean"].item() - sum(ratios) / 3) < 1e-12
    assert abs(metrics["ratio_max"].value.item() - math.exp(1e-3)) < 1e-12
    # token k3 of KL(pi_old || pi): exp(lr) - 1 - lr over the 7 masked tokens
    kept = [lr for lr, m in zip(log_ratio.flatten().tolist(), mask.flatten().tolist()) if m]
    assert abs(metrics["approx_kl"].item() - sum(math.exp(x) - 1 - x for x in kept) / 7) < 1e-15
    assert all(v.dim() == 0 and not v.requires_grad
               for v in (getattr(m, "value", m) for m in metrics.values()))


def _random_batch(seed, B=8, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2.0
    # a per-sequence drift (sd 0.1) against clip bounds of ~0.05 in the tests: some
    # sequences clip, some do not
    lp = old + 0.1 * torch.randn(B, 1, generator=g, dtype=F64) + 0.05 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.25).to(F64)
    mask[1] = 0.0
    mask[4, 2:] = 0.0
    w = 0.5 + torch.rand(B, generator=g, dtype=F64)
    return lp, old, adv, mask, w


def _ref_gspo(lp, old, adv, mask, *, cl, ch, w=None):
    """Loss and its analytic gradient, per sequence in plain floats."""
    total, n_seq, clipped = 0.0, 0, 0
    grad = [[0.0] * len(row) for row in lp]
    for b in range(len(lp)):
        kept = [t for t in range(len(lp[b])) if mask[b][t]]
        if not kept:
            continue
        n_seq += 1
        s = math.exp(sum(lp[b][t] - old[b][t] for t in kept) / len(kept))
        a, wb = adv[b], 1.0 if w is None else w[b]
        unclipped, clip = -a * s, -a * min(max(s, 1 - cl), 1 + ch)
        total += wb * max(unclipped, clip)
        if clip > unclipped:
            clipped += 1
        else:
            for t in kept:
                grad[b][t] = -a * wb * s / len(kept)
    grad = [[g / n_seq for g in row] for row in grad]
    return total / n_seq, grad, clipped / n_seq


@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_matches_loop_reference_loss_and_gradient(weighted):
    lp, old, adv, mask, w = _random_batch(seed=0)
    w = w if weighted else None
    lp.requires_grad_(True)
    loss, metrics = gspo_policy_loss(lp, old, adv, mask, clip_low=0.05, clip_high=0.06, is_weights=w)
    loss.backward()
    ref, ref_grad, clip_frac = _ref_gspo(
        lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), cl=0.05, ch=0.06,
        w=None if w is None else w.tolist(),
    )
    assert abs(loss.item() - ref) < 1e-12
    torch.testing.assert_close(lp.grad, torch.tensor(ref_grad, dtype=F64), rtol=0, atol=1e-12)
    assert abs(metrics["clip_frac"].item() - clip_frac) < 1e-12
    assert 0.1 < clip_frac < 0.9  # both branches exercised


def test_gspo_equals_gspo_token_form_in_value_and_gradient():
    # GSPO-token written out: s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)], the clipped
    # surrogate per token, token-mean per sequence, mean over non-empty sequences
    lp, old, adv, mask, _ = _random_batch(seed=1)
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    loss, _ = gspo_policy_loss(a, old, adv, mask, clip_low=0.05, clip_high=0.05)
    loss.backward()
    n = mask.sum(-1)
    s = torch.exp(((b - old) * mask).sum(-1) / n.clamp(min=1))
    s_tok = s.detach()[:, None] * torch.exp(b - b.detach())
    A = adv[:, None]
    per_tok = torch.maximum(-A * s_tok, -A * s_tok.clamp(0.95, 1.05))
    per_seq = (per_tok * mask).sum(-1) / n.clamp(min=1)
    token_form = per_seq.sum() / (n > 0).sum()
    token_form.backward()
    assert abs(loss.item() - token_form.item()) < 1e-12
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


def test_gspo_token_advantages_and_token_weights_reduce_per_sequence():
    lp, old, adv, mask, w = _random_batch(seed=2)
    # broadcast [B] -> [B, T] with NaN at masked-out positions gives the same loss
    adv_bt = torch.where(mask != 0, adv[:, None].expand(-1, 6), torch.full((8, 6), NAN, dtype=F64))
    w_bt = w[:, None].expand(-1, 6).clone()
    a, _ = gspo_policy_loss(lp, old, adv, mask, clip_low=0.05, clip_high=0.05, is_weights=w)
    b, _ = gspo_policy_loss(lp, old, adv_bt, mask, clip_low=0.05, clip_high=0.05, is_weights=w_bt)
    assert abs(a.item() - b.item()) < 1e-12
    # a varying [B, T] advantage counts by its token-mean: row 0 with A = [1, 3] -> 2
    lp0 = torch.zeros(1, 2, dtype=F64)
    c, _ = gspo_policy_loss(lp0, lp0, torch.tensor([[1.0, 3.0]], dtype=F64), torch.ones(1, 2, dtype=F64))
    assert c.item() == -2.0


@pytest.mark.parametrize("chunks", [2, 4])
def test_gspo_micro_batches_sum_to_full_batch(chunks):
    lp, old, adv, mask, w = _random_batch(seed=3)
    full_lp = lp.clone().requires_grad_(True)
    full, _ = gspo_policy_loss(full_lp, old, adv, mask, clip_low=0.05, clip_high=0.05, is_weights=w)
    full.backward()
    den = loss_denominator(mask, aggregation="seq-mean-token-mean")
    assert den.item() == 7.0  # one of the 8 rows is empty
    micro_lp = lp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows in torch.arange(8).chunk(chunks):
        part, _ = gspo_policy_loss(
            micro_lp[rows], old[rows], adv[rows], mask[rows],
            clip_low=0.05, clip_high=0.05, is_weights=w[rows], denominator=den,
        )
        total = total + part
    total.backward()
    assert abs(total.item() - full.item()) < 1e-12
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, rtol=0, atol=1e-12)


def test_gspo_empty_mask_and_extreme_ratio_are_finite():
    lp = torch.full((2, 3), -float("inf"), requires_grad=True)
    loss, metrics = gspo_policy_loss(lp, torch.zeros(2, 3), torch.tensor([NAN, 1.0]), torch.zeros(2, 3))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3))
    assert all(v == 0.0 for v in scalars(metrics).values())
    # a sequence log-ratio of 100 is clamped to 20 before the exp: finite, fp32
    big = torch.full((1, 2), 100.0, requires_grad=True)
    loss, _ = gspo_policy_loss(big, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    assert abs(loss.item() - math.exp(20.0)) / math.exp(20.0) < 1e-6
    loss.backward()
    assert torch.equal(big.grad, torch.zeros(1, 2))


def test_gspo_errors_name_the_argument():
    lp, old, adv, mask, w = _random_batch(seed=4)
    with pytest.raises(ValueError, match="gspo_policy_loss: clip_low=1.0"):
        gspo_policy_loss(lp, old, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high=-0.1"):
        gspo_policy_loss(lp, old, adv, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match="advantages has shape"):
        gspo_policy_loss(lp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="is_weights has shape"):
        gspo_policy_loss(lp, old, adv, mask, is_weights=w[:3])
    with pytest.raises(ValueError, match="old_logprobs"):
        gspo_policy_loss(lp, old[:, :2], adv, mask)
