"""Reward shaping before the advantage: scores placed on tokens, the KL penalty inside
the reward, DAPO's overlong penalty and its dynamic-sampling filter."""

from __future__ import annotations

import torch

from rltune.algos.advantages import _check_token_tensors, _grouped
from rltune.algos.checks import check_real, result_dtype


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's score on its last masked-in token, 0 elsewhere: ``[B], [B, T] ->
    [B, T]`` in ``scores``' dtype.

    A row with no masked-in token gets 0 everywhere, and its score (which may be NaN)
    never reaches the result; ``T = 0`` gives ``[B, 0]``. The sparse per-token reward of
    RLHF with PPO or REINFORCE++.
    """
    caller = "last_token_rewards"
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(
            f"{caller}: scores {tuple(scores.shape)} and mask {tuple(mask.shape)}; "
            f"expected [B] and [B, T]"
        )
    keep = mask != 0
    T = mask.shape[1]
    if T == 0:  # no token to put a score on (amax over nothing is an error)
        return scores.new_zeros(mask.shape)
    positions = torch.arange(T, device=mask.device).expand_as(keep)
    # the largest masked-in position; -1 for an empty row, which matches no position
    last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=-1, keepdim=True)
    at_last = positions == last
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    return torch.where(at_last, scores.unsqueeze(-1), zero)


def kl_shaped_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, kl_coef: float
) -> torch.Tensor:
    """Token rewards with the KL penalty inside the reward (Ziegler et al. 2019; Ouyang et
    al. 2022), as PPO and REINFORCE++ use them::

        r_t = score * [t is the last masked-in token] - kl_coef * kl_t     (masked tokens)

    ``scores`` is ``[B]``, ``kl`` the per-token estimate ``[B, T]`` (``kl_penalty``) and
    ``mask`` ``[B, T]``; 0 at masked-out positions (a NaN there does not leak). Detached:
    a reward is data, not a term to differentiate. ``kl_coef`` is finite and >= 0.
    Returns ``scores``' dtype when it is floating; integer or bool scores (a 0/1
    verifier's) give ``kl``'s floating dtype (else the default float dtype), so the
    penalty is not truncated away.
    """
    caller = "kl_shaped_rewards"
    if not check_real(kl_coef, "kl_coef", caller) >= 0:
        raise ValueError(f"{caller}: kl_coef={kl_coef} must be >= 0")
    _check_token_tensors(caller, mask, kl=kl)
    dtype = scores.dtype if scores.is_floating_point() else result_dtype(kl.dtype)
    with torch.no_grad():
        keep = mask != 0
        rewards = last_token_rewards(scores.detach().to(dtype), mask)
        kl = torch.where(keep, kl.detach().to(rewards.dtype), torch.zeros_like(rewards))
        return torch.where(keep, rewards - kl_coef * kl, torch.zeros_like(rewards))


def overlong_penalty(
    lengths: torch.Tensor, *, max_len: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), ``[B] -> [B]``.

    With completion length ``L``, ``max_len`` the generation limit and ``buffer`` the
    length of the soft zone before it::

        0                                            L <= max_len - buffer
        -penalty * (L - (max_len - buffer)) / buffer  max_len - buffer < L <= max_len
        -penalty                                      L > max_len

    Added to the task reward. ``buffer=0`` leaves only the step at ``max_len``; a
    fractional buffer follows the same formula. ``max_len >= 1``, ``0 <= buffer <=
    max_len`` and ``penalty >= 0``, all finite numbers. The paper's penalty is 1. Returns
    the default float dtype for integer ``lengths``, else ``lengths``' dtype.
    """
    caller = "overlong_penalty"
    if check_real(max_len, "max_len", caller) < 1:
        raise ValueError(f"{caller}: max_len={max_len} must be >= 1")
    if not 0 <= check_real(buffer, "buffer", caller) <= max_len:
        raise ValueError(f"{caller}: buffer={buffer} must be in [0, max_len={max_len}]")
    if not check_real(penalty, "penalty", caller) >= 0:
        raise ValueError(f"{caller}: penalty={penalty} must be >= 0")
    if lengths.dim() != 1:
        raise ValueError(f"{caller}: lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    L = lengths.to(dtype)
    # how far into the soft zone, in [0, 1]; buffer=0 has no zone: 0 up to max_len
    if buffer > 0:
        into = ((L - (max_len - buffer)) / buffer).clamp(0.0, 1.0)
    else:
        into = torch.zeros_like(L)
    return torch.where(L > max_len, torch.full_like(L, -penalty), -penalty * into)


def groups_with_spread(
    rewards: torch.Tensor, group_size: int, *, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """DAPO's dynamic-sampling filter (Yu et al. 2025): ``[n_groups]`` bool, True for a
    group that has at least two valid rewards and not all of them equal.

    A group whose rewards are all equal gets zero group-relative advantages and so adds
    nothing but noise to the batch; DAPO keeps sampling until the batch is filled with
    groups that have spread. Groups, ``valid``, NaN in invalid rows and the rewards'
    dtypes (integer and bool rewards are compared as float32) as in ``group_advantages``.
    """
    r, ok, n = _grouped(rewards, group_size, valid, "groups_with_spread")
    inf = torch.full_like(r, float("inf"))
    largest = torch.where(ok, r, -inf).amax(dim=1)
    smallest = torch.where(ok, r, inf).amin(dim=1)
    return (n.squeeze(1) >= 2) & (largest > smallest)
