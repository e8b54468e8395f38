"""Out-of-domain inputs of the algorithm functions: refused with an error that names the
argument, or computed to the documented value (worked out by hand in the comments)."""

import math

import pytest
import torch

from rltune.algos import (
    adaptive_kl_coef,
    aggregate_loss,
    bradley_terry_loss,
    dpo_loss,
    gae,
    group_advantages,
    group_baseline,
    groups_with_spread,
    gspo_policy_loss,
    importance_weight_metrics,
    kl_shaped_rewards,
    last_token_rewards,
    loss_denominator,
    masked_whiten,
    overlong_penalty,
    ppo_policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    sft_loss,
    simpo_loss,
    value_loss,
)
from rltune.metrics.types import scalars

F64 = torch.float64


def _batch():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.2, -0.3, -0.4, -0.1], [-2.0, -1.0, -3.0, -0.7]], dtype=F64)
    return lp, lp + 0.1, torch.tensor([1.0, -0.5, 2.0], dtype=F64), torch.ones(3, 4, dtype=F64)


# ---------------------------------------------------------------- mask shapes


def test_aggregate_loss_refuses_a_mask_that_would_broadcast():
    per_token = torch.arange(12.0, dtype=F64).view(3, 4)
    # the token-mean over all 12 entries is (0 + 1 + ... + 11) / 12 = 5.5
    assert aggregate_loss(per_token, torch.ones(3, 4)).item() == pytest.approx(5.5, abs=1e-12)
    for mask in (torch.ones(3, 1), torch.ones(1, 4), torch.ones(4)):
        with pytest.raises(ValueError, match=r"aggregate_loss: .*mask"):
            aggregate_loss(per_token, mask)


def test_loss_denominator_needs_a_2d_mask():
    # five sequences of three tokens, one of them empty: 4 non-empty sequences, 12 tokens
    mask = torch.ones(5, 3)
    mask[2] = 0
    assert loss_denominator(mask, aggregation="seq-mean-token-mean").item() == 4.0
    assert loss_denominator(mask).item() == 12.0
    for bad in (torch.ones(5), torch.ones(2, 3, 4)):
        with pytest.raises(ValueError, match=r"loss_denominator: mask has shape .* expected 2-D \[B, T\]"):
            loss_denominator(bad, aggregation="seq-mean-token-mean")


@pytest.mark.parametrize("max_len", [1.5, True, 0])
def test_max_len_must_be_a_positive_int(max_len):
    mask = torch.ones(2, 3)
    with pytest.raises((TypeError, ValueError), match="max_len"):
        loss_denominator(mask, aggregation="seq-mean-token-sum-norm", max_len=max_len)


# ---------------------------------------------------------------- ppo advantages and clip


def test_ppo_takes_sequence_or_token_advantages_only():
    lp, old, adv, mask = _batch()
    per_seq, _ = ppo_policy_loss(lp, old, adv, mask)
    per_tok, _ = ppo_policy_loss(lp, old, adv[:, None].expand(3, 4), mask)
    assert per_seq.item() == per_tok.item()
    # on-policy with ratio exp(-0.1) inside the clip: -A r per token, token-mean over 12
    # tokens: -(1 - 0.5 + 2) * 4 * exp(-0.1) / 12
    assert per_seq.item() == pytest.approx(-2.5 * 4 * math.exp(-0.1) / 12, abs=1e-12)
    for bad in (torch.tensor([5.0]), torch.tensor(5.0), torch.ones(1, 4), torch.ones(3, 1),
                torch.ones(1, 3, 4), torch.ones(4), torch.ones(4, 3), torch.ones(3, 5)):
        with pytest.raises(ValueError, match=r"ppo_policy_loss: advantages has shape .* expected \[B\]"):
            ppo_policy_loss(lp, old, bad.to(F64), mask)


@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, gspo_policy_loss])
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"clip_low": -0.5}, "clip_low"), ({"clip_low": 1.5}, "clip_low"), ({"clip_low": float("nan")}, "clip_low"),
     ({"clip_high": -0.1}, "clip_high"), ({"clip_high": float("nan")}, "clip_high")],
)
def test_clip_range_is_checked_alike(loss_fn, kwargs, name):
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=f"{loss_fn.__name__}: {name}="):
        loss_fn(lp, old, adv, mask, **kwargs)


@pytest.mark.parametrize("dual_clip", [float("nan"), float("inf"), 1.0])
def test_dual_clip_must_be_finite_above_one(dual_clip):
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(lp, old, adv, mask, dual_clip=dual_clip)


def test_policy_losses_need_floating_2d_logprobs():
    lp, old, adv, mask = _batch()
    with pytest.raises(TypeError, match="ppo_policy_loss: logprobs has dtype torch.int64"):
        ppo_policy_loss(lp.long(), old, adv, mask)
    with pytest.raises(ValueError, match=r"gspo_policy_loss: mask has shape \(4,\)"):
        gspo_policy_loss(lp[0], old[0], adv[:1], mask[0])


# ---------------------------------------------------------------- explicit denominators


@pytest.mark.parametrize("den", [0, 0.0, -3.0, float("nan"), float("inf")])
def test_a_number_denominator_must_be_finite_and_positive(den):
    lp, old, adv, mask = _batch()
    calls = [
        lambda: ppo_policy_loss(lp, old, adv, mask, denominator=den),
        lambda: gspo_policy_loss(lp, old, adv, mask, denominator=den),
        lambda: sft_loss(lp, mask, denominator=den),
        lambda: value_loss(lp, old, old, mask, denominator=den),
        lambda: aggregate_loss(lp, mask, denominator=den),
        lambda: dpo_loss(adv, adv - 1, adv, adv, beta=0.1, denominator=den),
        lambda: bradley_terry_loss(adv, adv - 1, denominator=den),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="denominator"):
            call()


def test_a_tensor_denominator_must_be_0_dim():
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"ppo_policy_loss: denominator has shape \(3,\)"):
        ppo_policy_loss(lp, old, adv, mask, denominator=torch.ones(3))
    with pytest.raises(ValueError, match=r"simpo_loss: denominator has shape \(1,\)"):
        simpo_loss(adv, adv - 1, beta=1.0, gamma=0.5, denominator=torch.ones(1))
    with pytest.raises(TypeError, match="denominator"):
        sft_loss(lp, mask, denominator=True)
    # the log-probs sum to -5 - 1 - 6.7 = -12.7: NLL 12.7 over a 0-dim denominator 10
    loss, _ = sft_loss(lp, mask, denominator=torch.tensor(10.0))
    assert loss.item() == pytest.approx(1.27, abs=1e-12)
    # an empty whole batch has the tensor denominator 0: loss 0, not NaN
    empty = torch.zeros(3, 4, dtype=F64)
    loss, _ = ppo_policy_loss(lp, old, adv, empty, denominator=loss_denominator(empty))
    assert loss.item() == 0.0


# ---------------------------------------------------------------- dtypes


def test_kl_shaped_rewards_keeps_the_penalty_for_integer_scores():
    kl, mask = torch.full((2, 3), 0.3), torch.ones(2, 3)
    # 0.1 * 0.3 = 0.03 off every token; the score on the last one
    want = torch.tensor([[-0.03, -0.03, 0.97], [-0.03, -0.03, 1.97]])
    for scores in (torch.tensor([1, 2]), torch.tensor([1.0, 2.0])):
        got = kl_shaped_rewards(scores, kl, mask, kl_coef=0.1)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rewards_give_the_float32_advantages(dtype):
    # mean 250, deviations (750, -250, -250, -250), sample variance (750^2 + 3 * 250^2) / 3
    # = 250000, std 500: A = (1.5, -0.5, -0.5, -0.5), exact in float16 and bfloat16
    r = torch.tensor([1000.0, 0, 0, 0], dtype=dtype)
    adv = group_advantages(r, 4)
    assert adv.dtype == dtype
    torch.testing.assert_close(adv.float(), torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=0)
    # leave-one-out: 1000 - 0 and 0 - 1000 / 3, rounded once to the rewards' dtype
    rloo = rloo_advantages(r, 4)
    assert rloo.dtype == dtype
    want = torch.tensor([1000.0, -1000 / 3, -1000 / 3, -1000 / 3]).to(dtype)
    torch.testing.assert_close(rloo, want, rtol=0, atol=0)


def test_half_precision_token_rewards_in_reinforce_pp():
    # returns (gamma 1): row 0 (1000, 1000), row 1 (0, 0); mean 500, population std 500
    rewards = torch.tensor([[0, 1000.0], [0, 0]], dtype=torch.float16)
    adv = reinforce_pp_advantages(rewards, torch.ones(2, 2))
    assert adv.dtype == torch.float16
    torch.testing.assert_close(adv.float(), torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), rtol=0, atol=1e-3)


def test_integer_and_bool_rewards_are_averaged_as_floats():
    for r in (torch.tensor([1, 0, 0, 0]), torch.tensor([True, False, False, False])):
        adv = group_advantages(r, 4, eps=0.0)
        assert adv.dtype == torch.get_default_dtype()
        torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=1e-7)
        torch.testing.assert_close(group_baseline(r, 4), torch.tensor([0.75, -0.25, -0.25, -0.25]), rtol=0, atol=0)
    # the filter takes what the estimator takes
    assert groups_with_spread(torch.tensor([1, 0, 0, 0, 2, 2, 2, 2]), 4).tolist() == [True, False]
    assert groups_with_spread(torch.tensor([True, False, True, True]), 2).tolist() == [True, False]


def test_bradley_terry_on_integer_scores_and_a_0_dim_margin():
    loss, metrics = bradley_terry_loss(torch.tensor([1, 2]), torch.tensor([0, 0]))
    # (-log sig(1) - log sig(2)) / 2 = (log(1 + e^-1) + log(1 + e^-2)) / 2
    want = (math.log1p(math.exp(-1)) + math.log1p(math.exp(-2))) / 2
    assert loss.item() == pytest.approx(want, abs=1e-7)
    assert metrics["accuracy"].item() == 1.0
    c, r = torch.tensor([1.0, 2.0], dtype=F64), torch.zeros(2, dtype=F64)
    as_float, _ = bradley_terry_loss(c, r, margin=0.5)
    as_tensor, _ = bradley_terry_loss(c, r, margin=torch.tensor(0.5, dtype=F64))
    assert as_float.item() == as_tensor.item()


def test_preference_logps_must_be_floating():
    x = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="dpo_loss: chosen_logps has dtype torch.int64"):
        dpo_loss(x, x, x, x, beta=0.1)
    with pytest.raises(TypeError, match="simpo_loss: chosen_logps"):
        simpo_loss(x, x, beta=0.1, gamma=0.0)


# ---------------------------------------------------------------- hyper-parameters


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_group_advantages_eps(eps):
    with pytest.raises(ValueError, match=f"group_advantages: eps={eps}"):
        group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, eps=eps)


def test_masked_whiten_eps():
    # eps = 0 on a constant input: variance 0, deviations 0, so 0 (not 0 / 0)
    torch.testing.assert_close(masked_whiten(torch.ones(3), torch.ones(3), eps=0.0), torch.zeros(3), rtol=0, atol=0)
    # eps = 0 elsewhere is the plain standardisation: (1, 3) -> mean 2, population std 1
    torch.testing.assert_close(masked_whiten(torch.tensor([1.0, 3.0]), torch.ones(2), eps=0.0),
                               torch.tensor([-1.0, 1.0]), rtol=0, atol=0)
    for eps in (-1e-8, float("nan")):
        with pytest.raises(ValueError, match="masked_whiten: eps="):
            masked_whiten(torch.ones(3), torch.ones(3), eps=eps)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"n_steps": float("nan")}, "n_steps"), ({"n_steps": -1}, "n_steps"), ({"n_steps": float("inf")}, "n_steps"),
     ({"coef": float("inf")}, "coef"), ({"target": float("nan")}, "target"), ({"horizon": float("inf")}, "horizon"),
     ({"observed_kl": torch.tensor([0.1, 0.2])}, "observed_kl")],
)
def test_adaptive_kl_coef_refuses_non_finite_arguments(kwargs, name):
    args = {"coef": 0.1, "observed_kl": 0.2, "target": 0.1, "horizon": 1.0, "n_steps": 1, **kwargs}
    coef, observed = args.pop("coef"), args.pop("observed_kl")
    with pytest.raises(ValueError, match=f"adaptive_kl_coef: {name}"):
        adaptive_kl_coef(coef, observed, **args)


def test_adaptive_kl_coef_reads_a_one_element_tensor():
    # err = clip(0.2 / 0.1 - 1, -0.2, 0.2) = 0.2; 0.1 * (1 + 0.2 * 1 / 1) = 0.12
    assert adaptive_kl_coef(0.1, torch.tensor([0.2]), target=0.1, horizon=1, n_steps=1) == pytest.approx(0.12)


@pytest.mark.parametrize("beta", [float("inf"), float("nan"), 0.0])
def test_preference_beta_must_be_finite_and_positive(beta):
    x = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="dpo_loss: beta="):
        dpo_loss(x, x - 1, x, x, beta=beta)
    with pytest.raises(ValueError, match="simpo_loss: beta="):
        simpo_loss(x, x - 1, beta=beta, gamma=0.0)


@pytest.mark.parametrize("group_size", [2.0, True, "2"])
def test_group_size_must_be_an_int(group_size):
    for fn in (group_advantages, group_baseline, rloo_advantages, groups_with_spread):
        with pytest.raises(TypeError, match=f"{fn.__name__}: group_size=.* must be an int"):
            fn(torch.ones(4), group_size)


# ---------------------------------------------------------------- empty batches


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_empty_batches_give_zero_losses_and_metrics(shape):
    lp = torch.zeros(shape, dtype=F64)
    adv = torch.zeros(shape[0], dtype=F64)
    for fn in (ppo_policy_loss, gspo_policy_loss):
        loss, metrics = fn(lp, lp, adv, lp)
        assert loss.item() == 0.0 and loss.dim() == 0
        assert all(v == 0.0 for v in scalars(metrics).values())
    metrics = importance_weight_metrics(lp, lp, lp, lp)
    assert all(v.item() == 0.0 for v in metrics.values())


def test_token_estimators_on_zero_tokens():
    empty = torch.zeros(2, 0)
    advantages, returns = gae(empty, empty, empty, gamma=1.0, lam=1.0)
    assert advantages.shape == returns.shape == (2, 0)
    assert last_token_rewards(torch.ones(2), empty).shape == (2, 0)
    assert reinforce_pp_advantages(empty, empty).shape == (2, 0)
    assert kl_shaped_rewards(torch.ones(2), empty, empty, kl_coef=0.1).shape == (2, 0)


# ---------------------------------------------------------------- overlong penalty


def test_overlong_penalty_follows_the_formula_for_a_fractional_buffer():
    # M = 8, b = 0.5: the zone is (7.5, 8]; L = 8 -> -(8 - 7.5) / 0.5 = -1, L = 7.75 -> -0.5
    got = overlong_penalty(torch.tensor([8.0, 7.75, 7.0, 9.0]), max_len=8, buffer=0.5)
    torch.testing.assert_close(got, torch.tensor([-1.0, -0.5, 0.0, -1.0]), rtol=0, atol=0)
    # M = 10, b = 2.5, p = 2: L = 9 -> -2 * (9 - 7.5) / 2.5 = -1.2
    got = overlong_penalty(torch.tensor([9.0]), max_len=10, buffer=2.5, penalty=2.0)
    torch.testing.assert_close(got, torch.tensor([-1.2]), rtol=0, atol=1e-7)
    # an integer buffer as before: M = 8, b = 4, L = 6 -> -(6 - 4) / 4
    assert overlong_penalty(torch.tensor([6]), max_len=8, buffer=4).item() == -0.5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"buffer": float("nan")}, "buffer"), ({"penalty": float("inf")}, "penalty"), ({"buffer": True}, "buffer"),
     ({"max_len": float("inf")}, "max_len")],
)
def test_overlong_penalty_refuses_non_finite_arguments(kwargs, name):
    args = {"max_len": 8, "buffer": 2, "penalty": 1.0, **kwargs}
    with pytest.raises((TypeError, ValueError), match=f"overlong_penalty: {name}"):
        overlong_penalty(torch.tensor([8]), **args)


# ---------------------------------------------------------------- no host reads


def test_the_checks_read_no_tensor_values():
    # meta tensors have no data: any read of a value on the host (.item(), float(), bool(),
    # a comparison in an `if`) raises, as it would wait for the device on a GPU
    d = "meta"
    lp, m, adv, den = torch.zeros(3, 4, device=d), torch.ones(3, 4, device=d), torch.zeros(3, device=d), \
        torch.zeros((), device=d)
    ppo_policy_loss(lp, lp, adv, m, denominator=den, dual_clip=3.0, is_weights=lp)
    gspo_policy_loss(lp, lp, adv, m, denominator=den)
    sft_loss(lp, m, denominator=den)
    value_loss(lp, lp, lp, m, clip=0.2, denominator=den)
    aggregate_loss(lp, m, aggregation="seq-mean-token-sum-norm", denominator=den, max_len=4)
    loss_denominator(m, aggregation="seq-mean-token-sum-norm", max_len=4)
    group_advantages(torch.zeros(4, device=d, dtype=torch.float16), 2, eps=0.0)
    rloo_advantages(torch.zeros(4, device=d, dtype=torch.long), 2)
    groups_with_spread(torch.zeros(4, device=d, dtype=torch.long), 2)
    masked_whiten(lp, m, eps=0.0)
    reinforce_pp_advantages(lp.half(), m)
    gae(lp, lp, m, gamma=1.0, lam=0.9)
    kl_shaped_rewards(torch.zeros(3, dtype=torch.long, device=d), lp, m, kl_coef=0.1)
    importance_weight_metrics(lp, lp, lp, m)
    dpo_loss(adv, adv, adv, adv, beta=0.1, denominator=den)
    bradley_terry_loss(adv.long(), adv.long(), margin=torch.zeros((), device=d), denominator=den)
