"""Policy losses (PPO/GRPO clipped surrogate, GSPO, SFT) and their aggregation over
tokens and sequences.

Every loss here takes per-token tensors ``[B, T]`` and a mask ``[B, T]`` (1 on tokens the
policy produced) and returns ``(loss, metrics)``: a 0-dim loss with gradient and a dict
of detached 0-dim tensors (no ``.item()``, so no host sync in the train step).

Micro-batching. A learner that splits a batch into micro-batches passes ``denominator``:
the normaliser of the *whole* batch (``loss_denominator(full_mask, aggregation=...)``).
Each call then returns ``numerator(micro-batch) / denominator`` and the micro-batch losses
sum to exactly the full-batch loss, whatever the split. With ``denominator=None`` the call
normalises by its own count. An explicit ``denominator`` is a 0-dim tensor or a number
(anything else, such as a ``[B]`` tensor, is refused): a number must be finite and > 0. A
tensor's value is not read (on an accelerator that would be a host sync every step), so
it is a precondition: >= 0, and 0 only when the whole batch has nothing masked in
(``loss_denominator`` meets it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from rltune.algos.checks import check_floating, check_int, denominator_tensor
from rltune.algos.kl import KL_ESTIMATORS
from rltune.algos.reduce import masked_mean, masked_sum, safe_divide
from rltune.metrics.types import Max, Sum

LOG_RATIO_BOUND = 20.0
"""``log(pi / pi_old)`` is clamped to ``[-20, 20]`` before ``exp`` (as verl does): beyond
that the ratio is clipped anyway for one sign of the advantage, and for the other an fp32
``exp`` would overflow to inf and turn the loss into inf/NaN. Outside the bound the
gradient is 0."""


@dataclass(frozen=True)
class _Aggregation:
    """``loss = numerator(per_token, mask) / (denominator or count(mask))``, with
    ``count(mask) * max_len`` instead when ``per_max_len`` is set."""

    numerator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    count: Callable[[torch.Tensor], torch.Tensor]
    per_max_len: bool = False


def _token_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(per_token, mask)


def _sum_of_seq_token_means(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # A sequence with an all-zero mask has token-mean 0 (masked_mean), so it adds nothing.
    return masked_mean(per_token, mask, dim=-1).sum()


def _sum_of_seq_token_sums(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(per_token, mask, dim=-1).sum()


def _num_tokens(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum()


def _num_nonempty_seqs(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) != 0).sum().to(mask.dtype)


AGGREGATIONS: dict[str, _Aggregation] = {
    # every token of the batch weighs the same (DAPO; long answers weigh more per sequence)
    "token-mean": _Aggregation(_token_sum, _num_tokens),
    # every sequence weighs the same, its tokens share that weight (original GRPO)
    "seq-mean-token-mean": _Aggregation(_sum_of_seq_token_means, _num_nonempty_seqs),
    # every sequence weighs the same, each token counts fully (no length normalisation)
    "seq-mean-token-sum": _Aggregation(_sum_of_seq_token_sums, _num_nonempty_seqs),
    # Dr. GRPO (Liu et al. 2025): token sum over (sequences x a constant max_len), so that
    # neither a sequence's own length nor the batch's lengths scale its tokens' gradient
    "seq-mean-token-sum-norm": _Aggregation(
        _sum_of_seq_token_sums, _num_nonempty_seqs, per_max_len=True
    ),
}


def _lookup_aggregation(aggregation: str, caller: str) -> _Aggregation:
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"{caller}: aggregation={aggregation!r}; expected one of {sorted(AGGREGATIONS)}"
        )
    return AGGREGATIONS[aggregation]


def _check_max_len(max_len: int | None, caller: str) -> None:
    if max_len is not None:
        check_int(max_len, "max_len", caller, minimum=1)


def _check_token_mask(caller: str, mask: torch.Tensor, per_token: torch.Tensor | None = None) -> None:
    """``mask`` must be 2-D ``[B, T]`` and, when given, ``per_token`` of the same shape:
    a broadcast mask would count its own entries in the denominator but the broadcast
    ones in the numerator."""
    if mask.dim() != 2:
        raise ValueError(f"{caller}: mask has shape {tuple(mask.shape)}; expected 2-D [B, T]")
    if per_token is not None and per_token.shape != mask.shape:
        raise ValueError(
            f"{caller}: per_token has shape {tuple(per_token.shape)} and mask "
            f"{tuple(mask.shape)}; expected both [B, T] (a mask is not broadcast)"
        )


def _count(mask: torch.Tensor, aggregation: str, max_len: int | None, caller: str) -> torch.Tensor:
    """The normaliser of ``aggregation`` for ``mask`` (already a floating tensor)."""
    agg = _lookup_aggregation(aggregation, caller)
    _check_max_len(max_len, caller)
    if not agg.per_max_len:
        return agg.count(mask)
    if max_len is None:
        raise ValueError(
            f"{caller}: aggregation={aggregation!r} divides by (number of sequences x "
            f"max_len) and needs max_len, the constant completion length (for example the "
            f"generation limit), or an explicit denominator; got max_len=None"
        )
    return agg.count(mask) * max_len


def loss_denominator(
    mask: torch.Tensor, *, aggregation: str = "token-mean", max_len: int | None = None
) -> torch.Tensor:
    """The normaliser ``aggregation`` divides by for ``mask`` ``[B, T]`` (0-dim tensor).

    Token count for "token-mean"; number of sequences with at least one masked token for
    the "seq-mean-token-mean" and "seq-mean-token-sum" modes; that number times
    ``max_len`` for "seq-mean-token-sum-norm" (which requires ``max_len``; the other
    modes ignore it). Compute it on the full batch and pass it as ``denominator`` to
    every micro-batch call. A mask of another shape than ``[B, T]`` is refused.
    """
    _check_token_mask("loss_denominator", mask)
    m = mask if mask.is_floating_point() else mask.to(torch.float32)
    return _count(m, aggregation, max_len, "loss_denominator")


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token-mean",
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` the way ``aggregation`` says (see
    ``AGGREGATIONS``), divided by ``denominator`` (module docstring). For extra loss terms,
    such as a KL penalty, that must weigh tokens exactly as the policy loss does.
    ``max_len`` is the constant length of "seq-mean-token-sum-norm" (needed there when
    ``denominator`` is None). ``per_token`` and ``mask`` must both be ``[B, T]``: the mask
    is not broadcast."""
    m = mask if mask.is_floating_point() else mask.to(per_token.dtype)
    return _aggregate(per_token, m, aggregation, denominator, "aggregate_loss", max_len=max_len)


def _aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    denominator: float | torch.Tensor | None,
    caller: str,
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    agg = _lookup_aggregation(aggregation, caller)
    _check_token_mask(caller, mask, per_token)
    if denominator is None:
        den = _count(mask, aggregation, max_len, caller)
    else:
        _check_max_len(max_len, caller)
        den = denominator_tensor(denominator, per_token, caller)
    # den == 0 only when nothing is masked in (a denominator's precondition, see
    # denominator_tensor), so the numerator is 0 too: loss 0, not NaN.
    return safe_divide(agg.numerator(per_token, mask), den)


def _check_shapes(caller: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{caller}: shapes differ: {shapes}")


def _check_policy_inputs(caller: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                         mask: torch.Tensor) -> None:
    """The token tensors of a policy loss: one shape, 2-D ``[B, T]``, floating log-probs."""
    _check_shapes(caller, logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    _check_token_mask(caller, mask)
    check_floating(caller, logprobs=logprobs, old_logprobs=old_logprobs)


def _token_advantages(advantages: torch.Tensor, mask: torch.Tensor, caller: str) -> torch.Tensor:
    """``advantages`` ``[B, T]`` as is, ``[B]`` (one per sequence) as ``[B, 1]``; any other
    shape is refused rather than broadcast (a ``[1]`` tensor would give every sequence
    the same advantage)."""
    if advantages.shape == mask.shape:
        return advantages
    if advantages.shape == mask.shape[:1]:
        return advantages.unsqueeze(-1)
    raise ValueError(
        f"{caller}: advantages has shape {tuple(advantages.shape)}; expected [B] "
        f"{tuple(mask.shape[:1])} (one per sequence) or [B, T] {tuple(mask.shape)} (one per token)"
    )


def _masked_max(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Largest ``x`` where ``keep`` is nonzero, for non-negative ``x``; 0 when nothing is
    kept, also for an empty tensor (``amax`` of nothing is an error)."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(keep != 0, x, torch.zeros_like(x)).amax()


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss and where the clip and the dual clip were active."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # The loss is max(unclipped, clipped); the gradient flows through the unclipped branch
    # unless clipping made the loss strictly larger (then it is constant in the ratio).
    is_clipped = clipped > unclipped
    per_token = torch.where(is_clipped, clipped, unclipped)
    if dual_clip is None:
        return per_token, is_clipped, torch.zeros_like(is_clipped)
    cap = -dual_clip * advantages
    is_capped = (advantages < 0) & (cap < per_token)
    return torch.where(is_capped, cap, per_token), is_clipped, is_capped


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss (PPO, Schulman et al. 2017), as used by GRPO.

    Per token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``::

        l = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        l = min(l, -dual_clip * A)   where A < 0     # dual clip, Ye et al. 2020
        l = l * is_weights                          # detached importance weights

    then ``l`` is aggregated by ``aggregation`` (see ``AGGREGATIONS``) and divided by
    ``denominator`` (module docstring). Separate ``clip_low``/``clip_high`` give DAPO's
    clip-higher. ``logprobs``, ``old_logprobs``, ``mask`` (and ``is_weights``) are
    ``[B, T]`` (floating log-probs); ``advantages`` is ``[B, T]`` or ``[B]`` (one value per
    sequence), any other shape is refused, not broadcast. ``0 <= clip_low < 1``,
    ``clip_high >= 0``, ``dual_clip > 1`` and finite. An empty batch (``B = 0`` or
    ``T = 0``) gives loss 0 and zero metrics. ``log(r)`` is clamped to
    ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]``. ``max_len`` is the constant length of the
    "seq-mean-token-sum-norm" aggregation (Dr. GRPO), an int >= 1.

    Metrics (detached, masked means over this call's tokens): ``clip_frac`` (share of
    tokens where the clipped branch was taken), ``dual_clip_frac``, ``approx_kl`` (k3
    estimate of ``KL(pi_old || pi)`` from tokens sampled by ``pi_old``:
    ``r - 1 - log r``, non-negative), ``ratio_mean``, ``ratio_max`` (a :class:`Max`; 0 when nothing is
    masked in).
    """
    caller = "ppo_policy_loss"
    _check_policy_inputs(caller, logprobs, old_logprobs, mask)
    _check_clip_range(clip_low, clip_high, caller)
    if dual_clip is not None and not (dual_clip > 1.0 and math.isfinite(dual_clip)):
        raise ValueError(f"{caller}: dual_clip={dual_clip} must be finite and > 1 (or None to disable)")
    _lookup_aggregation(aggregation, caller)
    m = mask.to(logprobs.dtype)
    keep = m != 0
    advantages = _token_advantages(advantages, m, caller)  # [B] -> [B, 1], over the tokens
    adv = torch.where(keep, advantages, torch.zeros_like(m))  # zeroed at padding, as the ratio
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, m)
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    per_token, is_clipped, is_capped = _clipped_surrogate(
        ratio, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    if is_weights is not None:
        _check_shapes(caller, logprobs=logprobs, is_weights=is_weights)
        per_token = per_token * is_weights.detach()
    loss = _aggregate(per_token, m, aggregation, denominator, caller, max_len=max_len)
    return loss, _ppo_metrics(m, is_clipped, is_capped, log_ratio, ratio)


def _masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      m: torch.Tensor) -> torch.Tensor:
    """``logprobs - old_logprobs`` ``[B, T]``, 0 where the mask ``m`` is 0. Padding is
    zeroed *before* the exp: a where() after an inf would still send NaN gradients
    (0 * inf) back through the masked-out entries."""
    return torch.where(m != 0, logprobs - old_logprobs, torch.zeros_like(m))


@torch.no_grad()
def _ppo_metrics(m: torch.Tensor, is_clipped: torch.Tensor, is_capped: torch.Tensor,
                 log_ratio: torch.Tensor, ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """``ppo_policy_loss``'s metrics: masked means over the tokens of ``m``."""
    return {
        "clip_frac": masked_mean(is_clipped.to(m.dtype), m),
        "dual_clip_frac": masked_mean(is_capped.to(m.dtype), m),
        "approx_kl": masked_mean(KL_ESTIMATORS["k3"](-log_ratio), m),
        "ratio_mean": masked_mean(ratio, m),
        "ratio_max": Max(_masked_max(ratio, m)),
    }


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the target tokens, token-mean.

    ``loss = -sum(logprobs * mask) / (denominator or sum(mask))``; ``logprobs`` and
    ``mask`` are ``[B, T]``. ``denominator`` as in the module docstring.
    Metrics (detached): ``nll`` (this call's own token-mean NLL) and ``num_tokens`` (a :class:`Sum`).
    """
    caller = "sft_loss"
    _check_shapes(caller, logprobs=logprobs, mask=mask)
    m = mask.to(logprobs.dtype)
    loss = _aggregate(-logprobs, m, "token-mean", denominator, caller)
    with torch.no_grad():
        metrics = {"nll": masked_mean(-logprobs, m), "num_tokens": Sum(m.sum())}
    return loss, metrics


def _per_sequence(x: torch.Tensor, mask: torch.Tensor, name: str, caller: str) -> torch.Tensor:
    """``x`` as one value per sequence ``[B]``: ``[B]`` as is, ``[B, T]`` by its masked
    token-mean (the value itself when it is broadcast over the sequence's tokens)."""
    if x.shape == mask.shape:
        return masked_mean(x, mask, dim=-1)
    if x.shape == mask.shape[:1]:
        return x
    raise ValueError(
        f"{caller}: {name} has shape {tuple(x.shape)}; expected [B] {tuple(mask.shape[:1])} "
        f"or [B, T] {tuple(mask.shape)}"
    )


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    is_weights: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (GSPO, Zheng et al. 2025): the PPO clip applied
    to one length-normalised ratio per sequence.

    For sequence ``i`` with masked tokens ``t`` (``n_i`` of them) and advantage ``A_i``::

        s_i = exp( (1 / n_i) * sum_t (logprobs_it - old_logprobs_it) )
        l_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_low, 1 + clip_high)) * w_i
        loss = sum_{i non-empty} l_i / (denominator or number of non-empty sequences)

    Gradient. ``s_i`` is computed as ``exp(mean log ratio)``, so where the unclipped branch
    is taken::

        d loss / d logprobs_it = -A_i * w_i * s_i * mask_it / n_i / denominator

    and 0 where the clipped branch is (or ``|mean log ratio| > LOG_RATIO_BOUND``, where
    it is clamped). This is also the gradient of "GSPO-token", whose token ratio is
    ``sg[s_i] * pi(y_it) / sg[pi(y_it)]`` averaged over the tokens, when the advantage is
    one value per sequence, as it is here: value and gradient coincide.

    ``logprobs``, ``old_logprobs`` and ``mask`` are ``[B, T]``; ``advantages`` and
    ``is_weights`` (detached weights ``w``, 1 when None) are ``[B]`` or ``[B, T]``, a
    ``[B, T]`` tensor being reduced to its masked token-mean per sequence. The defaults
    ``clip_low=3e-4``, ``clip_high=4e-4`` are the paper's: a sequence ratio moves far less
    than a token ratio; the clip range is checked as in ``ppo_policy_loss``. ``denominator``
    for micro-batches is the number of non-empty sequences of the whole batch,
    ``loss_denominator(mask, aggregation="seq-mean-token-mean")``. An empty batch gives
    loss 0 and zero metrics.

    Metrics (detached): ``clip_frac`` and ``ratio_mean``, ``ratio_max`` over this call's
    non-empty sequences; ``approx_kl`` the token-level k3 estimate of ``KL(pi_old || pi)``
    as in ``ppo_policy_loss``.
    """
    caller = "gspo_policy_loss"
    _check_policy_inputs(caller, logprobs, old_logprobs, mask)
    _check_clip_range(clip_low, clip_high, caller)
    m = mask.to(logprobs.dtype)
    seq_m = (m != 0).any(dim=-1).to(m.dtype)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, m)
    ratio = masked_mean(log_ratio, m, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    adv = _per_sequence(advantages, m, "advantages", caller).to(m.dtype)
    adv = torch.where(seq_m != 0, adv, torch.zeros_like(seq_m))
    per_seq, is_clipped, _ = _clipped_surrogate(
        ratio, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=None
    )
    if is_weights is not None:
        w = _per_sequence(is_weights.detach().to(m.dtype), m, "is_weights", caller)
        per_seq = per_seq * torch.where(seq_m != 0, w, torch.zeros_like(w))
    loss = _aggregate(per_seq.unsqueeze(-1), seq_m.unsqueeze(-1), "token-mean", denominator, caller)
    return loss, _gspo_metrics(m, seq_m, is_clipped, log_ratio, ratio)


def _check_clip_range(clip_low: float, clip_high: float, caller: str) -> None:
    # written so that NaN fails: a NaN bound would clamp every ratio to NaN
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"{caller}: clip_low={clip_low} must be in [0, 1)")
    if not clip_high >= 0.0:
        raise ValueError(f"{caller}: clip_high={clip_high} must be >= 0")


@torch.no_grad()
def _gspo_metrics(m: torch.Tensor, seq_m: torch.Tensor, is_clipped: torch.Tensor,
                  log_ratio: torch.Tensor, ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """``gspo_policy_loss``'s metrics: over the non-empty sequences ``seq_m`` ``[B]``, the
    k3 estimate over the tokens of ``m`` ``[B, T]``."""
    return {
        "clip_frac": masked_mean(is_clipped.to(m.dtype), seq_m),
        "ratio_mean": masked_mean(ratio, seq_m),
        "ratio_max": Max(_masked_max(ratio, seq_m)),
        "approx_kl": masked_mean(KL_ESTIMATORS["k3"](-log_ratio), m),
    }
