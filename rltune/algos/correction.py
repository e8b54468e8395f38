"""Rollout correction: importance weights for the gap between the inference engine that
sampled the tokens (behaviour policy ``mu``) and the learner's log-probs of the same
tokens and weights (``pi_old``).

The two differ even at the same weights (kernels, precision, batch-dependent reductions),
and more when generation runs ahead of the learner. Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training", correct the gradient with a
truncated importance weight ``min(pi_old / mu, C)``; a sequence-level variant drops whole
sequences whose likelihood ratio is far from 1. The weights multiply the per-token loss
(``is_weights=`` of the policy losses) and carry no gradient.
"""

from __future__ import annotations

from typing import Callable

import torch

from rltune.algos.losses import LOG_RATIO_BOUND, _check_shapes
from rltune.algos.reduce import masked_mean


def _token_truncate(log_ratio: torch.Tensor, keep: torch.Tensor, cap: float) -> torch.Tensor:
    # exp of the clamped log-ratio: finite, and the cap applies long before the bound
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    return ratio.clamp(max=cap)


def _seq_mask(log_ratio: torch.Tensor, keep: torch.Tensor, cap: float) -> torch.Tensor:
    # the geometric-mean ratio exp(mean log ratio) lies in [1/cap, cap] exactly when the
    # mean log-ratio lies in [-log cap, log cap]; compared in log space, nothing overflows
    seq_log_ratio = masked_mean(log_ratio, keep.to(log_ratio.dtype), dim=-1)
    bound = torch.log(torch.as_tensor(cap, dtype=log_ratio.dtype))
    inside = seq_log_ratio.abs() <= bound
    return inside.to(log_ratio.dtype).unsqueeze(-1).expand_as(log_ratio)


# mode -> weights from (log_ratio, keep, cap); log_ratio is 0 at masked-out positions
_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "token-truncate": _token_truncate,
    "seq-mask": _seq_mask,
}


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-truncate",
    cap: float = 2.0,
) -> torch.Tensor:
    """Detached rollout-correction weights ``[B, T]``, 0 at masked-out positions.

    With ``log rho_t = old_logprobs_t - behaviour_logprobs_t`` on the masked tokens::

        "token-truncate":  w_t = min(rho_t, cap)              truncated IS (Yao et al. 2025)
        "seq-mask":        w_t = 1 if 1/cap <= exp(mean_t log rho_t) <= cap else 0

    "seq-mask" takes the sequence's geometric-mean ratio (length-normalised, so long
    sequences are not dropped just for being long) and keeps or drops the whole sequence
    without reweighting it. ``cap`` must be >= 1 for "token-truncate" (``cap = 1`` is
    V-trace's ``rho_bar = 1``; below 1 even on-policy tokens would be down-weighted) and
    > 1 for "seq-mask" (``cap = 1`` would drop every sequence with any mismatch). The
    log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before the ``exp``.
    """
    caller = "importance_weights"
    if mode not in _MODES:
        raise ValueError(f"{caller}: mode={mode!r}; expected one of {sorted(_MODES)}")
    if mode == "seq-mask" and not cap > 1.0:
        raise ValueError(f"{caller}: cap={cap} must be > 1 for mode='seq-mask'")
    if not cap >= 1.0:
        raise ValueError(f"{caller}: cap={cap} must be >= 1 for mode={mode!r}")
    _check_shapes(caller, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    with torch.no_grad():
        keep = mask != 0
        zeros = torch.zeros_like(old_logprobs)
        log_ratio = torch.where(keep, old_logprobs - behaviour_logprobs, zeros)
        weights = _MODES[mode](log_ratio, keep, cap)
        return torch.where(keep, weights, zeros)


def _kept_extreme(w: torch.Tensor, keep: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """The largest (or smallest) ``w`` where ``keep``; 0 when nothing is kept, also for an
    empty tensor (``amax`` of nothing is an error)."""
    zero = w.new_zeros(())
    if w.numel() == 0:
        return zero
    bound = torch.full_like(w, float("-inf") if largest else float("inf"))
    picked = torch.where(keep, w, bound)
    return torch.where(keep.any(), picked.amax() if largest else picked.amin(), zero)


def importance_weight_metrics(
    weights: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Detached 0-dim metrics of the engine/learner gap and of ``weights``, over the
    masked tokens (all 0 when nothing is masked in).

    ``is_abs_logp_diff``: mean ``|old - behaviour|``. ``is_weight_mean``,
    ``is_weight_max``, ``is_weight_min``: of the weights. ``is_masked_frac``: share of
    tokens with weight 0 (the tokens "seq-mask" dropped). ``is_truncated_frac``: share of
    tokens whose non-zero weight is below their own ratio ``exp(old - behaviour)`` (the
    tokens "token-truncate" capped; with "seq-mask" it counts kept tokens whose ratio is
    above 1 and is not a truncation: read ``is_masked_frac`` there). An empty batch
    (``B = 0`` or ``T = 0``) gives all 0.
    """
    caller = "importance_weight_metrics"
    _check_shapes(
        caller, weights=weights, old_logprobs=old_logprobs,
        behaviour_logprobs=behaviour_logprobs, mask=mask,
    )
    with torch.no_grad():
        keep = mask != 0
        m = keep.to(weights.dtype)
        zeros = torch.zeros_like(weights)
        log_ratio = torch.where(keep, old_logprobs - behaviour_logprobs, zeros)
        w = torch.where(keep, weights.detach(), zeros)
        ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        return {
            "is_abs_logp_diff": masked_mean(log_ratio.abs(), m),
            "is_weight_mean": masked_mean(w, m),
            "is_weight_max": _kept_extreme(w, keep, largest=True),
            "is_weight_min": _kept_extreme(w, keep, largest=False),
            "is_masked_frac": masked_mean((w == 0).to(m.dtype), m),
            "is_truncated_frac": masked_mean(((w != 0) & (w < ratio)).to(m.dtype), m),
        }
