"""Losses on preference pairs: DPO and its variants, SimPO, and the Bradley-Terry loss of
reward-model training.

Every input is ``[B]``, one entry per (chosen, rejected) pair. The loss is the mean over
pairs, ``sum over this call's pairs / (denominator or B)``: pass the whole batch's number
of pairs as ``denominator`` when splitting it into micro-batches, and the micro-batch
losses sum to the whole-batch loss. Metrics are detached 0-dim means over this call's
pairs. An explicit ``denominator`` follows the rules of ``rltune.algos.losses``: a number
is finite and > 0, a tensor is 0-dim (its value is a precondition, not read).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from rltune.algos.checks import (
    check_floating,
    check_real,
    check_real_dtype,
    denominator_tensor,
    result_dtype,
)
from rltune.algos.reduce import safe_divide


def _check_pairs(caller: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"{caller}: expected 1-D [B] tensors of one shape, got {shapes}")


def _mean_over_pairs(
    per_pair: torch.Tensor, denominator: float | torch.Tensor | None, caller: str
) -> torch.Tensor:
    if denominator is None:
        den = torch.tensor(float(per_pair.numel()), dtype=per_pair.dtype, device=per_pair.device)
    else:
        den = denominator_tensor(denominator, per_pair, caller)
    # den == 0 only for an empty batch (a denominator's precondition), whose sum is 0 too
    return safe_divide(per_pair.sum(), den)


def _mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over pairs, 0 (not NaN) for an empty batch."""
    return safe_divide(x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device))


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's names for the implicit rewards of a preference loss (detached means)."""
    with torch.no_grad():
        chosen, rejected = chosen.detach(), rejected.detach()
        return {
            "rewards/chosen": _mean(chosen),
            "rewards/rejected": _mean(rejected),
            "rewards/margin": _mean(chosen - rejected),
            "rewards/accuracy": _mean((chosen > rejected).to(chosen.dtype)),
        }


# ---------------------------------------------------------------- DPO family
# Each takes h (the policy-over-reference log-ratio margin), beta and the label smoothing
# eps, and returns the per-pair loss.


def _dpo_sigmoid(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # DPO (Rafailov et al. 2023); eps > 0: conservative DPO (labels flipped with prob. eps)
    return -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def _dpo_ipo(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # IPO (Azar et al. 2023): regress the margin onto 1 / (2 beta) instead of pushing it to
    # infinity, which DPO does on deterministic preferences
    return (h - 1.0 / (2.0 * beta)) ** 2


def _dpo_hinge(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # SLiC (Zhao et al. 2023) hinge on the margin, with margin 1 / beta in units of h
    return torch.relu(1.0 - beta * h)


def _dpo_robust(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    # rDPO (Chowdhury et al. 2024): an unbiased estimate of the clean-label DPO loss when
    # each label is flipped with probability eps
    return (
        -(1.0 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)
    ) / (1.0 - 2.0 * eps)


_DPO_KINDS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _dpo_sigmoid,
    "ipo": _dpo_ipo,
    "hinge": _dpo_hinge,
    "robust": _dpo_robust,
}
_SMOOTHED_KINDS = frozenset({"sigmoid", "robust"})
"""The kinds that take ``label_smoothing``; the others reject a non-zero one."""


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct Preference Optimization and variants, on sequence log-probs ``[B]``.

    With ``c, r`` the policy's and ``c_ref, r_ref`` the reference model's log-probs of the
    chosen and rejected completions, ``h = (c - c_ref) - (r - r_ref)`` and
    ``eps = label_smoothing``, per pair::

        "sigmoid": -(1 - eps) log sig(beta h) - eps log sig(-beta h)   DPO, Rafailov et al. 2023
                                                 (eps > 0: conservative DPO)
        "ipo":     (h - 1 / (2 beta))^2                                  IPO, Azar et al. 2023
        "hinge":   max(0, 1 - beta h)                                    SLiC, Zhao et al. 2023
        "robust":  ((1 - eps)(-log sig(beta h)) - eps(-log sig(-beta h))) / (1 - 2 eps)
                                                                         rDPO, Chowdhury et al. 2024

    The log-probs are whatever the caller passes, normally summed over the completion's
    tokens, as in every one of these papers, IPO included. TRL's IPO instead passes
    per-token means (length-normalised log-probs), which makes ``h`` and so the target
    ``1 / (2 beta)`` per token; pass means here to reproduce that. ``label_smoothing`` is
    in ``[0, 0.5)`` and only "sigmoid" and "robust" take it.

    Loss: mean over pairs (module docstring for ``denominator``). Metrics (TRL's names):
    ``rewards/chosen`` (mean of ``beta (c - c_ref)``), ``rewards/rejected``,
    ``rewards/margin`` (mean of their difference), ``rewards/accuracy`` (share of pairs
    whose chosen reward is the larger).
    """
    caller = "dpo_loss"
    if kind not in _DPO_KINDS:
        raise ValueError(f"{caller}: kind={kind!r}; expected one of {sorted(_DPO_KINDS)}")
    if not check_real(beta, "beta", caller) > 0:
        raise ValueError(f"{caller}: beta={beta} must be > 0")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{caller}: label_smoothing={label_smoothing} must be in [0, 0.5)")
    if label_smoothing != 0.0 and kind not in _SMOOTHED_KINDS:
        raise ValueError(
            f"{caller}: kind={kind!r} takes no label_smoothing (got {label_smoothing}); "
            f"only {sorted(_SMOOTHED_KINDS)} do"
        )
    _check_pairs(
        caller, chosen_logps=chosen_logps, rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
    )
    check_floating(caller, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    chosen_log_ratio = chosen_logps - ref_chosen_logps
    rejected_log_ratio = rejected_logps - ref_rejected_logps
    per_pair = _DPO_KINDS[kind](chosen_log_ratio - rejected_log_ratio, beta, label_smoothing)
    loss = _mean_over_pairs(per_pair, denominator, caller)
    return loss, _reward_metrics(beta * chosen_log_ratio, beta * rejected_log_ratio)


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO (Meng et al. 2024): a reference-free margin loss on length-normalised
    log-probs.

    ``chosen_logps`` and ``rejected_logps`` are ``[B]`` *average per-token* log-probs of
    the completions (sum over tokens / number of tokens). Per pair::

        l = -log sig(beta * (c - r) - gamma)

    ``gamma`` is the target reward margin (>= 0). Loss: mean over pairs (module docstring
    for ``denominator``). Metrics as for ``dpo_loss``, with rewards ``beta * c`` and
    ``beta * r``.
    """
    caller = "simpo_loss"
    if not check_real(beta, "beta", caller) > 0:
        raise ValueError(f"{caller}: beta={beta} must be > 0")
    if not check_real(gamma, "gamma", caller) >= 0:
        raise ValueError(f"{caller}: gamma={gamma} must be >= 0")
    _check_pairs(caller, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    check_floating(caller, chosen_logps=chosen_logps, rejected_logps=rejected_logps)
    per_pair = -F.logsigmoid(beta * (chosen_logps - rejected_logps) - gamma)
    loss = _mean_over_pairs(per_pair, denominator, caller)
    return loss, _reward_metrics(beta * chosen_logps, beta * rejected_logps)


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    *,
    margin: float | torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry loss of a reward model's scalar scores (Ouyang et al. 2022).

    ``chosen_scores`` and ``rejected_scores`` are ``[B]``; per pair::

        l = -log sig(c - r - margin)

    ``margin`` (a float, a 0-dim tensor or ``[B]``, 0 when None) asks for a larger gap on
    pairs rated further apart (Llama 2, Touvron et al. 2023). Integer or bool scores are
    compared in the default float dtype. Loss: mean over pairs (module docstring for
    ``denominator``). Metrics: ``accuracy`` (share of pairs with ``c > r``), ``margin``
    (mean of ``c - r``), ``chosen_score``, ``rejected_score`` (means).
    """
    caller = "bradley_terry_loss"
    _check_pairs(caller, chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    check_real_dtype(caller, chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    if isinstance(margin, torch.Tensor) and margin.dim() != 0:
        _check_pairs(caller, chosen_scores=chosen_scores, margin=margin)
    dtype = torch.promote_types(result_dtype(chosen_scores.dtype), result_dtype(rejected_scores.dtype))
    chosen_scores, rejected_scores = chosen_scores.to(dtype), rejected_scores.to(dtype)
    gap = chosen_scores - rejected_scores
    per_pair = -F.logsigmoid(gap if margin is None else gap - margin)
    loss = _mean_over_pairs(per_pair, denominator, caller)
    with torch.no_grad():
        metrics = {
            "accuracy": _mean((gap > 0).to(gap.dtype)),
            "margin": _mean(gap.detach()),
            "chosen_score": _mean(chosen_scores.detach()),
            "rejected_score": _mean(rejected_scores.detach()),
        }
    return loss, metrics
