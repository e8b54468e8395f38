"""Advantage estimators that need no critic."""

from __future__ import annotations

from typing import Callable

import torch

from rltune.algos.reduce import safe_divide


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

    The std is the *sample* (unbiased, Bessel-corrected) one, as ``torch.std`` computes it
    in TRL's GRPO trainer, so the numbers match that reference.

    ``valid`` (``[B]`` bool, optional) marks rows that have a reward; a row whose reward
    function returned None or raised is invalid. Invalid rows are left out of their group's
    mean and std and get advantage 0; their entry in ``rewards`` may be NaN and never
    reaches the result. A group with fewer than two valid rows gives 0 to every row (a
    single sample has no baseline to compare with). A group whose valid rewards are all
    equal gives 0 advantages, not NaN. Returns ``[B]`` in ``rewards``' dtype.
    """
    if scale not in _GROUP_SCALES:
        raise ValueError(
            f"group_advantages: scale={scale!r}; expected one of {sorted(_GROUP_SCALES)}"
        )
    if rewards.dim() != 1:
        raise ValueError(
            f"group_advantages: rewards must be 1-D [B], got shape {tuple(rewards.shape)}"
        )
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"group_advantages: {rewards.shape[0]} rewards do not split into groups of "
            f"group_size={group_size}"
        )
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(
            f"group_advantages: valid has shape {tuple(valid.shape)}, "
            f"rewards {tuple(rewards.shape)}"
        )
    ok = valid.to(torch.bool).view(-1, group_size)
    zeros = torch.zeros_like(rewards).view(-1, group_size)
    r = torch.where(ok, rewards.view(-1, group_size), zeros)
    n = ok.sum(dim=1, keepdim=True).to(rewards.dtype)
    mean = safe_divide(r.sum(dim=1, keepdim=True), n)
    centred = torch.where(ok, r - mean, zeros)
    # n - 1 == 0 (one valid row) gives std 0 and centred is already 0 there.
    var = safe_divide((centred * centred).sum(dim=1, keepdim=True), (n - 1).clamp(min=0))
    adv = _GROUP_SCALES[scale](centred, var.sqrt(), eps)
    return torch.where(ok, adv, zeros).view(-1)
