"""Advantage estimators that need no critic (GRPO, Dr. GRPO, RLOO, REINFORCE++), and the
reverse scan over a sequence's masked-in tokens that GAE shares with REINFORCE++."""

from __future__ import annotations

from typing import Callable

import torch

from rltune.algos.checks import check_int, check_real, check_real_dtype, result_dtype, stat_dtype
from rltune.algos.reduce import masked_whiten, safe_divide


def _scale_by_std(centred: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    # std + eps == 0 only for a group without spread (centred == 0 too) and eps=0: 0, not NaN.
    return safe_divide(centred, std + eps)


def _no_scale(centred: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    return centred


# "std": GRPO (Shao et al. 2024, DeepSeekMath). "none": Dr. GRPO (Liu et al. 2025), which
# drops the division because it up-weights groups whose rewards barely differ.
_GROUP_SCALES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "std": _scale_by_std,
    "none": _no_scale,
}


def _grouped(
    rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None, caller: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the arguments and view them as groups.

    Returns ``(r, ok, n)``: rewards ``[G, K]`` with invalid entries set to 0 (a NaN there
    never reaches arithmetic), the valid mask ``[G, K]`` (bool) and the number of valid
    rows per group ``[G, 1]``; ``r`` and ``n`` in float32 (float64 for float64 rewards,
    :func:`stat_dtype`), so that half-precision rewards do not overflow in the statistics
    and integer or bool rewards can be averaged.
    """
    if rewards.dim() != 1:
        raise ValueError(f"{caller}: rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    check_real_dtype(caller, rewards=rewards)
    group_size = check_int(group_size, "group_size", caller, minimum=1)
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"{caller}: {rewards.shape[0]} rewards do not split into groups of "
            f"group_size={group_size}"
        )
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(
            f"{caller}: valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}"
        )
    ok = valid.to(torch.bool).view(-1, group_size)
    grouped = rewards.view(-1, group_size).to(stat_dtype(rewards.dtype))
    r = torch.where(ok, grouped, torch.zeros_like(grouped))
    n = ok.sum(dim=1, keepdim=True).to(r.dtype)
    return r, ok, n


def _centred(r: torch.Tensor, ok: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``r_i - mean of the group's valid r``, 0 on invalid rows (``[G, K]``)."""
    mean = safe_divide(r.sum(dim=1, keepdim=True), n)
    return torch.where(ok, r - mean, torch.zeros_like(r))


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: str = "std",
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages: each sample against the other samples of its prompt.

    ``rewards`` is ``[B]`` with ``B = n_groups * group_size`` and the rows of one group
    contiguous. Within a group g with valid rows V_g (``n_g = |V_g|``)::

        mean_g = sum_{j in V_g} r_j / n_g
        std_g  = sqrt( sum_{j in V_g} (r_j - mean_g)^2 / (n_g - 1) )   # sample std
        A_i    = (r_i - mean_g) / (std_g + eps)     # scale="std"  (GRPO)
        A_i    =  r_i - mean_g                      # scale="none" (Dr. GRPO)

    The std is the *sample* (unbiased, Bessel-corrected) one, as TRL's GRPO trainer
    computes it; TRL adds ``eps = 1e-4`` where the default here is 1e-6 (``algo.adv_eps``
    sets it), so the numbers match that reference at ``eps=1e-4``.

    ``valid`` (``[B]`` bool, optional) marks rows that have a reward; a row whose reward
    function returned None or raised is invalid. Invalid rows are left out of their group's
    mean and std and get advantage 0; their entry in ``rewards`` may be NaN and never
    reaches the result. A group with fewer than two valid rows gives 0 to every row (a
    single sample has no baseline to compare with). A group whose valid rewards are all
    equal gives 0 advantages, not NaN.

    Precondition: the rewards of valid rows are finite. A NaN or inf there makes its
    group's advantages NaN; it is not checked (that would read the rewards every step),
    and the scorer never produces one: a reward that is not a finite number makes the
    row invalid. ``group_size`` is an int >= 1 that divides ``B``; ``eps`` is finite and
    >= 0. The statistics are computed in float32 (float64 for float64 rewards); returns
    ``[B]`` in ``rewards``' dtype when it is floating, else in the default float dtype.
    """
    caller = "group_advantages"
    if scale not in _GROUP_SCALES:
        raise ValueError(f"{caller}: scale={scale!r}; expected one of {sorted(_GROUP_SCALES)}")
    if not check_real(eps, "eps", caller) >= 0:
        raise ValueError(f"{caller}: eps={eps} must be >= 0")
    r, ok, n = _grouped(rewards, group_size, valid, caller)
    centred = _centred(r, ok, n)
    # n - 1 == 0 (one valid row) gives std 0 and centred is already 0 there.
    var = safe_divide((centred * centred).sum(dim=1, keepdim=True), (n - 1).clamp(min=0))
    adv = _GROUP_SCALES[scale](centred, var.sqrt(), eps)
    return torch.where(ok, adv, torch.zeros_like(adv)).view(-1).to(result_dtype(rewards.dtype))


def group_baseline(
    rewards: torch.Tensor, group_size: int, *, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Each reward minus the mean of its group's valid rewards, ``[B] -> [B]``.

    ``A_i = r_i - mean_{j in V_g} r_j``: the baseline of "REINFORCE++ with baseline"
    (Hu et al. 2025), whose token rewards are ``last_token_rewards(group_baseline(r))``
    (minus a KL term) fed to ``reinforce_pp_advantages``. Numerically the same as
    ``group_advantages(..., scale="none")``. Groups, ``valid`` and NaN in invalid rows as
    in ``group_advantages``; a group with one valid row gives it 0 (``r_i - r_i``).
    Returns ``rewards``' dtype when it is floating, else the default float dtype.
    """
    r, ok, n = _grouped(rewards, group_size, valid, "group_baseline")
    return _centred(r, ok, n).view(-1).to(result_dtype(rewards.dtype))


def rloo_advantages(
    rewards: torch.Tensor, group_size: int, *, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024; Kool et al. 2019), ``[B] -> [B]``.

    Each sample's baseline is the mean of the *other* valid samples of its group::

        A_i = r_i - sum_{j in V_g, j != i} r_j / (n_g - 1)
            = n_g / (n_g - 1) * (r_i - mean_g)

    Groups, ``valid`` and NaN in invalid rows as in ``group_advantages``: invalid rows are
    excluded from the baselines and get 0; a group with fewer than two valid rows (no
    other sample to compare with) gives 0 to every row. Dtypes as in ``group_advantages``.
    """
    r, ok, n = _grouped(rewards, group_size, valid, "rloo_advantages")
    others = r.sum(dim=1, keepdim=True) - r
    # n - 1 == 0: the one valid row has no baseline; safe_divide gives 0 and the row is
    # zeroed below together with the invalid rows.
    adv = r - safe_divide(others, (n - 1).clamp(min=0))
    adv = torch.where(ok & (n >= 2), adv, torch.zeros_like(adv))
    return adv.view(-1).to(result_dtype(rewards.dtype))


def _check_token_tensors(caller: str, mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"{caller}: mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(
                f"{caller}: {name} has shape {tuple(t.shape)}, mask {tuple(mask.shape)}"
            )


def _check_discount(caller: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{caller}: {name}={value} must be in [0, 1]")


def _discounted_suffix_sum(x: torch.Tensor, keep: torch.Tensor, discount: float) -> torch.Tensor:
    """``y_t = x_t + discount * y_{t'}`` with ``t'`` the next masked-in position after
    ``t`` (``y = 0`` past the last one), on the masked-in positions; 0 elsewhere.

    Masked-out positions are skipped, not treated as the end of the sequence: a tool's
    tokens in the middle of a multi-turn completion do not break the chain. ``x`` must be
    0 where ``keep`` is False. A loop over T, vectorised over B; ``T = 0`` gives ``[B, 0]``.
    """
    out = torch.zeros_like(x)
    carry = x.new_zeros(x.shape[:1])
    for t in range(x.shape[1] - 1, -1, -1):
        y = x[:, t] + discount * carry
        out[:, t] = torch.where(keep[:, t], y, torch.zeros_like(y))
        carry = torch.where(keep[:, t], y, carry)
    return out


def _next_kept(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` at the next masked-in position after ``t``, 0 when there is none (``[B, T]``)."""
    out = torch.zeros_like(x)
    carry = x.new_zeros(x.shape[:1])
    for t in range(x.shape[1] - 1, -1, -1):
        out[:, t] = carry
        carry = torch.where(keep[:, t], x[:, t], carry)
    return out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch.

    On the masked-in tokens of each sequence, skipping masked-out ones (as ``gae`` does)::

        G_t = r_t + gamma * G_{next masked-in token}      (G = 0 after the last one)
        A   = masked_whiten(G, mask)   # mean 0, variance 1 over all masked-in tokens

    ``token_rewards`` and ``mask`` are ``[B, T]``; rewards at masked-out positions are
    ignored (they may be NaN). Typical token rewards are
    ``kl_shaped_rewards(scores, kl, mask, kl_coef=...)``; with
    ``scores = group_baseline(rewards, group_size)`` this is "REINFORCE++ with baseline".
    Computed without gradient, in float32 (float64 for float64 rewards) so that
    half-precision rewards do not overflow; returned in ``token_rewards``' dtype when it is
    floating, else the default float dtype. 0 at masked-out positions; ``T = 0`` gives
    ``[B, 0]``.
    """
    caller = "reinforce_pp_advantages"
    _check_token_tensors(caller, mask, token_rewards=token_rewards)
    _check_discount(caller, "gamma", gamma)
    with torch.no_grad():
        keep = mask != 0
        rewards = token_rewards.detach().to(stat_dtype(token_rewards.dtype))
        r = torch.where(keep, rewards, torch.zeros_like(rewards))
        returns = _discounted_suffix_sum(r, keep, gamma)
        return masked_whiten(returns, keep.to(returns.dtype)).to(result_dtype(token_rewards.dtype))
