"""KL estimators (hand values, autograd against the analytic derivatives) and the
adaptive KL coefficient."""

import math

import pytest
import torch

from rltune.algos import adaptive_kl_coef, kl_penalty


def _pair():
    logprobs = torch.tensor([[0.5, -0.2, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 0.3, 0.0]], dtype=torch.float64)
    return logprobs, ref  # log_ratio = [0.5, -0.5, 0.0]


def test_k1_k2_k3_hand_values():
    lp, ref = _pair()
    k1 = torch.tensor([[0.5, -0.5, 0.0]], dtype=torch.float64)
    k2 = torch.tensor([[0.125, 0.125, 0.0]], dtype=torch.float64)  # 0.5 * 0.25
    # k3 = exp(-lr) - 1 + lr: exp(-0.5) - 0.5 = 0.106530659..., exp(0.5) - 1.5 = 0.148721270...
    k3 = torch.tensor([[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]], dtype=torch.float64)
    assert abs(k3[0, 0].item() - 0.10653066) < 1e-8 and abs(k3[0, 1].item() - 0.14872127) < 1e-8
    torch.testing.assert_close(kl_penalty(lp, ref, kind="k1"), k1, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl_penalty(lp, ref, kind="k2"), k2, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl_penalty(lp, ref, kind="k3"), k3, rtol=0, atol=1e-12)


ANALYTIC_GRAD = {
    "k1": lambda lr: torch.ones_like(lr),
    "k2": lambda lr: lr,
    "k3": lambda lr: 1.0 - torch.exp(-lr),
}


@pytest.mark.parametrize("kind", sorted(ANALYTIC_GRAD))
def test_gradient_matches_analytic_derivative(kind):
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(4, 7, generator=g, dtype=torch.float64)
    kl_penalty(lp, ref, kind=kind).sum().backward()
    expected = ANALYTIC_GRAD[kind]((lp - ref).detach())
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-6)


def test_k3_is_clamped_and_finite():
    lp = torch.tensor([[-200.0, 200.0]])
    ref = torch.zeros(1, 2)
    out = kl_penalty(lp, ref, kind="k3")
    # log_ratio clamped to [-20, 20]: exp(20) - 1 - 20 and exp(-20) - 1 + 20
    expected = torch.tensor([[math.exp(20.0) - 21.0, math.exp(-20.0) + 19.0]])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


def test_unknown_kind_and_shape_mismatch_are_errors():
    lp, ref = _pair()
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, kind="k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(lp, ref[:, :2], kind="k1")


# ---------------------------------------------------------------- adaptive KL coefficient


def test_adaptive_kl_coef_hand_values():
    kw = {"target": 0.1, "horizon": 10_000, "n_steps": 256}
    # KL 0.12: err = 0.12/0.1 - 1 = 0.2 -> 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    assert abs(adaptive_kl_coef(0.1, 0.12, **kw) - 0.100512) < 1e-12
    # KL 0.5: err 4 clipped to 0.2 -> the same
    assert abs(adaptive_kl_coef(0.1, torch.tensor(0.5), **kw) - 0.100512) < 1e-12
    # KL 0.09: err -0.1 -> 0.1 * (1 - 0.1 * 0.0256) = 0.099744
    assert abs(adaptive_kl_coef(0.1, 0.09, **kw) - 0.099744) < 1e-12
    # KL 0: err -1 clipped to -0.2 -> 0.1 * (1 - 0.2 * 0.0256) = 0.099488
    assert abs(adaptive_kl_coef(0.1, 0.0, **kw) - 0.099488) < 1e-12
    assert adaptive_kl_coef(0.1, 0.1, **kw) == 0.1  # on target: unchanged
    # n_steps > 5 * horizon would make the factor negative: floored at 0
    assert adaptive_kl_coef(0.1, 0.0, target=0.1, horizon=10, n_steps=60) == 0.0


def test_adaptive_kl_coef_errors():
    with pytest.raises(ValueError, match="adaptive_kl_coef: target=0"):
        adaptive_kl_coef(0.1, 0.1, target=0.0, horizon=10, n_steps=1)
    with pytest.raises(ValueError, match="horizon=-1"):
        adaptive_kl_coef(0.1, 0.1, target=0.1, horizon=-1, n_steps=1)
    with pytest.raises(ValueError, match="n_steps=-2"):
        adaptive_kl_coef(0.1, 0.1, target=0.1, horizon=10, n_steps=-2)
    with pytest.raises(ValueError, match="coef=-0.1"):
        adaptive_kl_coef(-0.1, 0.1, target=0.1, horizon=10, n_steps=1)
    with pytest.raises(ValueError, match="observed_kl=nan"):
        adaptive_kl_coef(0.1, float("nan"), target=0.1, horizon=10, n_steps=1)
