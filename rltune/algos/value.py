"""The critic's side of PPO: Generalised Advantage Estimation and the value loss."""

from __future__ import annotations

import torch

from rltune.algos.advantages import (
    _check_discount,
    _check_token_tensors,
    _discounted_suffix_sum,
    _next_kept,
)
from rltune.algos.losses import _aggregate, _check_shapes, _lookup_aggregation
from rltune.algos.reduce import masked_mean, safe_divide


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016); ``(advantages, returns)``.

    All tensors are ``[B, T]`` over the completion tokens. Over the masked-in tokens of a
    sequence, with ``t'`` the next masked-in token after ``t``::

        delta_t = r_t + gamma * V_t' - V_t          (V_t' = 0 after the last token)
        A_t     = delta_t + gamma * lam * A_t'      (A_t' = 0 after the last token)
        R_t     = A_t + V_t                         (the critic's regression target)

    The episode ends at the last masked-in token. Masked-out positions are skipped rather
    than ending the recursion (in a multi-turn completion the environment's tokens sit
    between the policy's), and their rewards and values are ignored (they may be NaN):
    put the reward on a masked-in token (``last_token_rewards``). Advantages and returns
    are 0 at masked-out positions. Computed without gradient, in the inputs' dtype.
    """
    caller = "gae"
    _check_token_tensors(caller, mask, rewards=rewards, values=values)
    _check_discount(caller, "gamma", gamma)
    _check_discount(caller, "lam", lam)
    with torch.no_grad():
        keep = mask != 0
        zeros = torch.zeros_like(values)
        r = torch.where(keep, rewards.detach().to(values.dtype), zeros)
        v = torch.where(keep, values.detach(), zeros)
        delta = torch.where(keep, r + gamma * _next_kept(v, keep) - v, zeros)
        advantages = _discounted_suffix_sum(delta, keep, gamma * lam)
        returns = torch.where(keep, advantages + v, zeros)
    return advantages, returns


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked entries; 0 when ``Var(R) = 0``."""

    def var(x: torch.Tensor) -> torch.Tensor:
        centred = x - masked_mean(x, m)
        return masked_mean(centred * centred, m)

    var_r = var(returns)
    return torch.where(var_r > 0, 1.0 - safe_divide(var(returns - values), var_r), torch.zeros_like(var_r))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    aggregation: str = "token-mean",
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Squared-error value loss, optionally with PPO's value clipping.

    Per token, with value ``V``, the value ``V_old`` at rollout time and target ``R``::

        l = 0.5 * (V - R)^2                                             clip=None
        l = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)  clip=c

    (the clipped form is the one of OpenAI's PPO baselines; it keeps the critic from
    moving further than ``c`` from ``V_old`` in one update when that lowers the loss).
    ``l`` is aggregated like the policy loss (``aggregation``, ``denominator``,
    ``max_len`` as in ``ppo_policy_loss``). All inputs are ``[B, T]``; gradient flows into
    ``values`` only.

    Metrics (detached, over this call's masked tokens): ``value_clip_frac`` (share where
    the clipped term was the larger; 0 without ``clip``), ``value_mean``, ``value_error``
    (mean of ``(V - R)^2``), ``explained_variance`` (``1 - Var(R - V) / Var(R)``, 0 when
    ``Var(R) = 0``; 1 for a perfect critic, 0 for one that predicts the mean).
    """
    caller = "value_loss"
    _check_shapes(caller, values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None and not clip > 0:
        raise ValueError(f"{caller}: clip={clip} must be > 0 (or None to disable)")
    _lookup_aggregation(aggregation, caller)
    m = mask.to(values.dtype)
    keep = m != 0
    zeros = torch.zeros_like(m)
    # zero padding first: a NaN there would otherwise come back as a NaN gradient
    v = torch.where(keep, values, zeros)
    v_old = torch.where(keep, old_values.detach(), zeros)
    r = torch.where(keep, returns.detach(), zeros)
    sq_error = (v - r) ** 2
    if clip is None:
        per_token, is_clipped = 0.5 * sq_error, torch.zeros_like(keep)
    else:
        v_clipped = v_old + (v - v_old).clamp(-clip, clip)
        sq_clipped = (v_clipped - r) ** 2
        is_clipped = sq_clipped > sq_error
        per_token = 0.5 * torch.where(is_clipped, sq_clipped, sq_error)
    loss = _aggregate(per_token, m, aggregation, denominator, caller, max_len=max_len)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": masked_mean(is_clipped.to(m.dtype), m),
            "value_mean": masked_mean(v.detach(), m),
            "value_error": masked_mean(sq_error.detach(), m),
            "explained_variance": _explained_variance(v.detach(), r, m),
        }
    return loss, metrics
