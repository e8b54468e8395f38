"""Preference losses: DPO family, SimPO, Bradley-Terry; hand values, loop references,
gradients, micro-batching."""

import math

import pytest
import torch

from rltune.algos import bradley_terry_loss, dpo_loss, simpo_loss

F64 = torch.float64


def _f64(values):
    return torch.tensor(values, dtype=F64)


def _softplus(x):
    """-log sigmoid(-x) = log(1 + e^x), in floats."""
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------- DPO


def _one_pair():
    # c - c_ref = -10 + 11 = 1, r - r_ref = -12 + 11 = -1, so h = 2
    return _f64([-10.0]), _f64([-12.0]), _f64([-11.0]), _f64([-11.0])


def test_dpo_hand_values_for_each_kind():
    pair = _one_pair()
    # beta 0.1, beta h = 0.2; -log sig(0.2) = log(1 + e^-0.2) = log(1.8187308) = 0.5981389
    base = math.log1p(math.exp(-0.2))
    assert abs(base - 0.5981389) < 1e-7
    cases = {
        ("sigmoid", 0.0): base,
        # (1 - eps) L + eps (L + 0.2) = L + 0.1 * 0.2 = 0.6181389
        ("sigmoid", 0.1): base + 0.02,
        # (h - 1 / (2 beta))^2 = (2 - 5)^2
        ("ipo", 0.0): 9.0,
        # relu(1 - 0.2)
        ("hinge", 0.0): 0.8,
        # ((1 - eps) L - eps (L + 0.2)) / (1 - 2 eps) = L - 0.02 / 0.8 = 0.5731389
        ("robust", 0.1): base - 0.025,
        ("robust", 0.0): base,
    }
    for (kind, eps), expected in cases.items():
        loss, metrics = dpo_loss(*pair, beta=0.1, kind=kind, label_smoothing=eps)
        assert abs(loss.item() - expected) < 1e-12, (kind, eps)
    assert abs(metrics["rewards/chosen"].item() - 0.1) < 1e-12  # 0.1 * 1
    assert abs(metrics["rewards/rejected"].item() + 0.1) < 1e-12  # 0.1 * -1
    assert abs(metrics["rewards/margin"].item() - 0.2) < 1e-12
    assert metrics["rewards/accuracy"].item() == 1.0
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def _ref_dpo(c, r, cr, rr, beta, kind, eps):
    losses = []
    for i in range(len(c)):
        h = (c[i] - cr[i]) - (r[i] - rr[i])
        pos, neg = _softplus(-beta * h), _softplus(beta * h)  # -log sig(beta h), -log sig(-beta h)
        losses.append({
            "sigmoid": (1 - eps) * pos + eps * neg,
            "ipo": (h - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - beta * h),
            "robust": ((1 - eps) * pos - eps * neg) / (1 - 2 * eps),
        }[kind])
    return sum(losses) / len(losses)


def _random_pairs(seed, B=10):
    g = torch.Generator().manual_seed(seed)
    return tuple(-5.0 + 3.0 * torch.randn(B, generator=g, dtype=F64) for _ in range(4))


@pytest.mark.parametrize("kind,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.2)])
def test_dpo_matches_loop_reference(kind, eps):
    pairs = _random_pairs(seed=0)
    loss, metrics = dpo_loss(*pairs, beta=0.3, kind=kind, label_smoothing=eps)
    assert abs(loss.item() - _ref_dpo(*(p.tolist() for p in pairs), 0.3, kind, eps)) < 1e-12
    c, r, cr, rr = (p.tolist() for p in pairs)
    chosen = [0.3 * (c[i] - cr[i]) for i in range(10)]
    rejected = [0.3 * (r[i] - rr[i]) for i in range(10)]
    assert abs(metrics["rewards/chosen"].item() - sum(chosen) / 10) < 1e-12
    assert abs(metrics["rewards/rejected"].item() - sum(rejected) / 10) < 1e-12
    accuracy = sum(a > b for a, b in zip(chosen, rejected)) / 10
    assert metrics["rewards/accuracy"].item() == accuracy and 0 < accuracy < 1


def test_dpo_sigmoid_gradient_matches_analytic():
    # d/dc_i = -beta sig(-beta h_i) / B, d/dr_i = +beta sig(-beta h_i) / B; the reference
    # log-probs get the opposite signs
    c, r, cr, rr = (p.requires_grad_(True) for p in _random_pairs(seed=1))
    loss, _ = dpo_loss(c, r, cr, rr, beta=0.5)
    loss.backward()
    h = ((c - cr) - (r - rr)).detach()
    g = -0.5 * torch.sigmoid(-0.5 * h) / 10
    torch.testing.assert_close(c.grad, g, rtol=0, atol=1e-12)
    torch.testing.assert_close(r.grad, -g, rtol=0, atol=1e-12)
    torch.testing.assert_close(cr.grad, -g, rtol=0, atol=1e-12)
    torch.testing.assert_close(rr.grad, g, rtol=0, atol=1e-12)


def test_cdpo_gradient_matches_analytic():
    # with label smoothing eps: d/dc_i = (-(1 - eps) beta sig(-beta h) + eps beta sig(beta h)) / B
    c, r, cr, rr = _random_pairs(seed=2)
    c.requires_grad_(True)
    loss, _ = dpo_loss(c, r, cr, rr, beta=0.5, label_smoothing=0.2)
    loss.backward()
    h = (c - cr) - (r - rr)
    expected = (-0.8 * 0.5 * torch.sigmoid(-0.5 * h) + 0.2 * 0.5 * torch.sigmoid(0.5 * h)).detach() / 10
    torch.testing.assert_close(c.grad, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- SimPO and Bradley-Terry


def test_simpo_hand_values():
    # beta 2, gamma 0.5: 2 * (-0.5 + 1) - 0.5 = 0.5; -log sig(0.5) = log(1 + e^-0.5) = 0.4740770
    loss, metrics = simpo_loss(_f64([-0.5]), _f64([-1.0]), beta=2.0, gamma=0.5)
    assert abs(loss.item() - math.log1p(math.exp(-0.5))) < 1e-12
    assert abs(loss.item() - 0.4740770) < 1e-7
    assert metrics["rewards/chosen"].item() == -1.0 and metrics["rewards/rejected"].item() == -2.0
    assert metrics["rewards/margin"].item() == 1.0 and metrics["rewards/accuracy"].item() == 1.0


def test_simpo_matches_loop_reference_and_gradient():
    c, r, _, _ = _random_pairs(seed=3)
    c.requires_grad_(True)
    loss, _ = simpo_loss(c, r, beta=2.5, gamma=1.2)
    ref = sum(_softplus(-(2.5 * (a - b) - 1.2)) for a, b in zip(c.tolist(), r.tolist())) / 10
    assert abs(loss.item() - ref) < 1e-12
    loss.backward()
    # d/dc_i of -log sig(z_i) / B with z_i = beta (c_i - r_i) - gamma is -beta sig(-z_i) / B
    z = (2.5 * (c - r) - 1.2).detach()
    torch.testing.assert_close(c.grad, -2.5 * torch.sigmoid(-z) / 10, rtol=0, atol=1e-12)


def test_bradley_terry_hand_values():
    # gaps [1, -1]: (log(1 + e^-1) + log(1 + e^1)) / 2 = (0.3132617 + 1.3132617) / 2
    c, r = _f64([2.0, 0.0]), _f64([1.0, 1.0])
    loss, metrics = bradley_terry_loss(c, r)
    assert abs(loss.item() - 0.8132617) < 1e-7
    assert abs(loss.item() - (_softplus(-1.0) + _softplus(1.0)) / 2) < 1e-12
    assert metrics["accuracy"].item() == 0.5 and metrics["margin"].item() == 0.0
    assert metrics["chosen_score"].item() == 1.0 and metrics["rejected_score"].item() == 1.0
    # margin 0.5: gaps - 0.5 = [0.5, -1.5]
    loss, _ = bradley_terry_loss(c, r, margin=0.5)
    assert abs(loss.item() - (_softplus(-0.5) + _softplus(1.5)) / 2) < 1e-12
    # per-pair margin [1, 0]: [0, -1] -> (log 2 + log(1 + e)) / 2
    loss, _ = bradley_terry_loss(c, r, margin=_f64([1.0, 0.0]))
    assert abs(loss.item() - (math.log(2.0) + _softplus(1.0)) / 2) < 1e-12


# ---------------------------------------------------------------- micro-batching, edges, errors


def _losses():
    c, r, cr, rr = _random_pairs(seed=4)
    margin = torch.rand(10, dtype=F64)
    yield "sigmoid", lambda s, den: dpo_loss(c[s], r[s], cr[s], rr[s], beta=0.2, label_smoothing=0.1, denominator=den)
    yield "ipo", lambda s, den: dpo_loss(c[s], r[s], cr[s], rr[s], beta=0.2, kind="ipo", denominator=den)
    yield "hinge", lambda s, den: dpo_loss(c[s], r[s], cr[s], rr[s], beta=0.2, kind="hinge", denominator=den)
    yield "robust", lambda s, den: dpo_loss(
        c[s], r[s], cr[s], rr[s], beta=0.2, kind="robust", label_smoothing=0.1, denominator=den
    )
    yield "simpo", lambda s, den: simpo_loss(c[s], r[s], beta=2.0, gamma=0.3, denominator=den)
    yield "bt", lambda s, den: bradley_terry_loss(c[s], r[s], margin=margin[s], denominator=den)


@pytest.mark.parametrize("name,fn", list(_losses()))
def test_micro_batches_sum_to_full_batch(name, fn):
    full, _ = fn(slice(None), None)
    parts = [fn(slice(a, b), 10)[0] for a, b in [(0, 3), (3, 4), (4, 10)]]
    assert abs(sum(p.item() for p in parts) - full.item()) < 1e-12, name


def test_empty_batch_is_zero_not_nan():
    e = torch.zeros(0, dtype=F64)
    loss, metrics = dpo_loss(e, e, e, e, beta=0.1)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    loss, metrics = bradley_terry_loss(e, e)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


def test_extreme_margins_are_finite():
    big = _f64([1e4])
    zero = _f64([0.0])
    loss, _ = dpo_loss(zero, big, zero, zero, beta=1.0)  # h = -1e4: loss ~ 1e4, not inf
    assert abs(loss.item() - 1e4) < 1e-6
    loss, _ = bradley_terry_loss(big, zero)
    assert loss.item() == 0.0


def test_errors_name_the_argument():
    x = _f64([0.0, 1.0])
    with pytest.raises(ValueError, match="dpo_loss: kind='kto'"):
        dpo_loss(x, x, x, x, beta=0.1, kind="kto")
    with pytest.raises(ValueError, match="dpo_loss: beta=0"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing=0.5"):
        dpo_loss(x, x, x, x, beta=0.1, kind="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="kind='ipo' takes no label_smoothing"):
        dpo_loss(x, x, x, x, beta=0.1, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(x, x, x, x[:1], beta=0.1)
    with pytest.raises(ValueError, match="simpo_loss: gamma=-1"):
        simpo_loss(x, x, beta=1.0, gamma=-1.0)
    with pytest.raises(ValueError, match="simpo_loss: beta=-1"):
        simpo_loss(x, x, beta=-1.0, gamma=0.0)
    with pytest.raises(ValueError, match="bradley_terry_loss: .*margin"):
        bradley_terry_loss(x, x, margin=_f64([1.0]))
    with pytest.raises(ValueError, match="denominator=-1"):
        bradley_terry_loss(x, x, denominator=-1.0)
