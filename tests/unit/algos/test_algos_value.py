"""GAE and the value loss: hand values, loop references, masked gaps, micro-batching."""

import math

import pytest
import torch

from rltune.algos import AGGREGATIONS, gae, loss_denominator, value_loss

F64 = torch.float64
NAN = float("nan")


def _f64(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- GAE


def test_gae_hand_values():
    # gamma = lam = 0.5, rewards [0, 0, 1], values [0.5, 0.25, 0.5], V after the end = 0:
    # delta_2 = 1 + 0.5*0 - 0.5        = 0.5
    # delta_1 = 0 + 0.5*0.5 - 0.25     = 0
    # delta_0 = 0 + 0.5*0.25 - 0.5     = -0.375
    # A_2 = 0.5; A_1 = 0 + 0.25*0.5 = 0.125; A_0 = -0.375 + 0.25*0.125 = -0.34375
    # returns = A + V = [0.15625, 0.375, 1.0]
    adv, ret = gae(_f64([[0.0, 0.0, 1.0]]), _f64([[0.5, 0.25, 0.5]]), _f64([[1, 1, 1]]), gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, _f64([[-0.34375, 0.125, 0.5]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, _f64([[0.15625, 0.375, 1.0]]), rtol=0, atol=1e-12)


def test_gae_masked_gap_in_the_middle_does_not_break_the_chain():
    # the same tokens as the hand case at positions 0, 3, 4; tool tokens at 1, 2 and
    # padding at 5 (NaN rewards and values there never reach the result)
    rewards = _f64([[0.0, NAN, 5.0, 0.0, 1.0, NAN]])
    values = _f64([[0.5, NAN, 9.0, 0.25, 0.5, NAN]])
    mask = _f64([[1, 0, 0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, _f64([[-0.34375, 0, 0, 0.125, 0.5, 0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, _f64([[0.15625, 0, 0, 0.375, 1.0, 0]]), rtol=0, atol=1e-12)


def test_gae_monte_carlo_and_one_step_limits():
    rewards = _f64([[1.0, 2.0, 3.0]])
    values = _f64([[0.5, -1.0, 2.0]])
    mask = _f64([[1, 1, 1]])
    # gamma = lam = 1: A = reward-to-go - V = [6 - 0.5, 5 + 1, 3 - 2], returns = [6, 5, 3]
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, _f64([[5.5, 6.0, 1.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, _f64([[6.0, 5.0, 3.0]]), rtol=0, atol=1e-12)
    # lam = 0: A = delta = r + gamma V' - V with gamma 0.9:
    # [1 + 0.9*(-1) - 0.5, 2 + 0.9*2 + 1, 3 - 2] = [-0.4, 4.8, 1.0]
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, _f64([[-0.4, 4.8, 1.0]]), rtol=0, atol=1e-12)


def _ref_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k} over each row's kept positions (floats)."""
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        kept = [t for t in range(len(rewards[b])) if mask[b][t] != 0]
        v = [values[b][t] for t in kept] + [0.0]
        deltas = [rewards[b][t] + gamma * v[i + 1] - v[i] for i, t in enumerate(kept)]
        for i, t in enumerate(kept):
            a = sum((gamma * lam) ** k * deltas[i + k] for k in range(len(kept) - i))
            adv[b][t] = a
            ret[b][t] = a + v[i]
    return adv, ret


def test_gae_matches_loop_reference_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 11, generator=g, dtype=F64)
    values = torch.randn(6, 11, generator=g, dtype=F64)
    mask = (torch.rand(6, 11, generator=g) > 0.3).to(F64)
    mask[1] = 0.0  # empty row
    mask[2, 7:] = 0.0  # right padding
    rewards[mask == 0] = NAN
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = _ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.9)
    torch.testing.assert_close(adv, _f64(ref_adv), rtol=0, atol=1e-10)
    torch.testing.assert_close(ret, _f64(ref_ret), rtol=0, atol=1e-10)
    assert torch.equal(adv[1], torch.zeros(11, dtype=F64))


def test_gae_fp32_and_no_gradient():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 5, generator=g)
    values = torch.randn(3, 5, generator=g, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad and adv.dtype == torch.float32
    ref_adv, _ = _ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.95)
    torch.testing.assert_close(adv, torch.tensor(ref_adv), rtol=0, atol=1e-6)


def test_gae_errors_name_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gae: gamma=1.5"):
        gae(x, x, x, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="gae: lam=-0.1"):
        gae(x, x, x, gamma=0.9, lam=-0.1)
    with pytest.raises(ValueError, match="values"):
        gae(x, torch.zeros(2, 4), x, gamma=0.9, lam=0.9)


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_values_with_clip():
    # V = [1, 2, 3], V_old = 1.5, R = 2, clip 0.2:
    # unclipped (V-R)^2             = [1, 0, 1]
    # clipped V = 1.5 + clamp(V - 1.5, +-0.2) = [1.3, 1.7, 1.7]; (Vc - R)^2 = [0.49, 0.09, 0.09]
    # max = [1, 0.09, 1]: the clipped term is larger only at token 1
    # loss = 0.5 * (1 + 0.09 + 1) / 3 = 0.3483333...
    values = _f64([[1.0, 2.0, 3.0]]).requires_grad_(True)
    old = _f64([[1.5, 1.5, 1.5]])
    returns = _f64([[2.0, 2.0, 2.0]])
    mask = _f64([[1, 1, 1]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert abs(loss.item() - 0.5 * 2.09 / 3.0) < 1e-12
    loss.backward()
    # d/dV of 0.5 (V - R)^2 / 3 = (V - R) / 3 on unclipped tokens; 0 where clipped
    torch.testing.assert_close(values.grad, _f64([[-1.0 / 3.0, 0.0, 1.0 / 3.0]]), rtol=0, atol=1e-12)
    assert abs(metrics["value_clip_frac"].item() - 1.0 / 3.0) < 1e-12
    assert abs(metrics["value_mean"].item() - 2.0) < 1e-12
    assert abs(metrics["value_error"].item() - 2.0 / 3.0) < 1e-12  # (1 + 0 + 1) / 3
    assert metrics["explained_variance"].item() == 0.0  # Var(R) = 0
    unclipped, m = value_loss(values, old, returns, mask)
    assert abs(unclipped.item() - 1.0 / 3.0) < 1e-12 and m["value_clip_frac"].item() == 0.0


def test_explained_variance_hand_value():
    # R = [1, 2, 3, 4], V = [1, 2, 3, 5]: R - V = [0, 0, 0, -1], mean -0.25,
    # Var = (3 * 0.0625 + 0.5625) / 4 = 0.1875; Var(R) = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    # EV = 1 - 0.1875 / 1.25 = 0.85. A fifth, masked-out entry holds NaN.
    values = _f64([[1.0, 2.0, 3.0, 5.0, NAN]])
    returns = _f64([[1.0, 2.0, 3.0, 4.0, NAN]])
    mask = _f64([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(values, values, returns, mask)
    assert abs(metrics["explained_variance"].item() - 0.85) < 1e-12
    assert abs(loss.item() - 0.5 * 1.0 / 4.0) < 1e-12
    assert all(math.isfinite(v.item()) for v in metrics.values())


def _ref_value_loss(v, old, ret, mask, *, clip, agg, max_len=None):
    seq_sums, seq_counts, n_clip, n = [], [], 0.0, 0.0
    for b in range(len(v)):
        s = c = 0.0
        for t in range(len(v[b])):
            if mask[b][t] == 0:
                continue
            e = (v[b][t] - ret[b][t]) ** 2
            if clip is not None:
                vc = old[b][t] + min(max(v[b][t] - old[b][t], -clip), clip)
                ec = (vc - ret[b][t]) ** 2
                n_clip += ec > e
                e = max(e, ec)
            s += 0.5 * e
            c += 1.0
            n += 1.0
        seq_sums.append(s)
        seq_counts.append(c)
    nonempty = [i for i, c in enumerate(seq_counts) if c]
    if agg == "token-mean":
        loss = sum(seq_sums) / n
    elif agg == "seq-mean-token-mean":
        loss = sum(seq_sums[i] / seq_counts[i] for i in nonempty) / len(nonempty)
    elif agg == "seq-mean-token-sum":
        loss = sum(seq_sums) / len(nonempty)
    else:
        loss = sum(seq_sums) / (len(nonempty) * max_len)
    return loss, n_clip / n


def _random_values(seed, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(B, T, generator=g, dtype=F64)
    old = v + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ret = torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    mask[3] = 0.0
    return v, old, ret, mask


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loop_reference(agg, clip):
    v, old, ret, mask = _random_values(seed=2)
    loss, metrics = value_loss(v, old, ret, mask, clip=clip, aggregation=agg, max_len=10)
    ref, clip_frac = _ref_value_loss(
        v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), clip=clip, agg=agg, max_len=10
    )
    assert abs(loss.item() - ref) < 1e-10
    assert abs(metrics["value_clip_frac"].item() - clip_frac) < 1e-12
    if clip is not None:
        assert 0.1 < clip_frac < 0.9  # both branches exercised
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_value_loss_micro_batches_sum_to_full_batch(agg):
    v, old, ret, mask = _random_values(seed=3)
    full_v = v.clone().requires_grad_(True)
    full, _ = value_loss(full_v, old, ret, mask, clip=0.2, aggregation=agg, max_len=10)
    full.backward()
    den = loss_denominator(mask, aggregation=agg, max_len=10)
    micro_v = v.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows in torch.arange(8).chunk(3):
        part, _ = value_loss(
            micro_v[rows], old[rows], ret[rows], mask[rows], clip=0.2, aggregation=agg, denominator=den
        )
        total = total + part
    total.backward()
    assert abs(total.item() - full.item()) < 1e-12
    torch.testing.assert_close(micro_v.grad, full_v.grad, rtol=0, atol=1e-12)


def test_value_loss_nan_padding_and_empty_mask():
    values = torch.tensor([[0.5, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, NAN]])
    returns = torch.tensor([[1.5, NAN]])
    loss, metrics = value_loss(values, old, returns, torch.tensor([[1.0, 0.0]]), clip=10.0)
    assert abs(loss.item() - 0.5) < 1e-7  # 0.5 * (0.5 - 1.5)^2
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-1.0, 0.0]]), rtol=0, atol=0)
    empty, metrics = value_loss(values, old, returns, torch.zeros(1, 2), clip=0.2)
    assert empty.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


def test_value_loss_errors():
    v, old, ret, mask = _random_values(seed=4)
    with pytest.raises(ValueError, match="value_loss: clip=0"):
        value_loss(v, old, ret, mask, clip=0.0)
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, old, ret[:, :3], mask)
    with pytest.raises(ValueError, match="aggregation='x'"):
        value_loss(v, old, ret, mask, aggregation="x")
    with pytest.raises(ValueError, match="value_loss: .*max_len"):
        value_loss(v, old, ret, mask, aggregation="seq-mean-token-sum-norm")
