"""Per-token KL estimators, and the adaptive KL coefficient.

Schulman, "Approximating KL divergence" (2020): estimators of ``KL(pi || ref)`` from
tokens sampled from ``pi``, with ``log_ratio = log pi(x) - log ref(x)``:

- ``k1 = log_ratio``                          unbiased, high variance, can be negative
- ``k2 = 0.5 * log_ratio^2``                  biased, low variance, non-negative
- ``k3 = exp(-log_ratio) - 1 + log_ratio``    unbiased, low variance, non-negative

Derivatives with respect to ``logprobs``: k1 -> 1, k2 -> log_ratio,
k3 -> 1 - exp(-log_ratio).
"""

from __future__ import annotations

from typing import Callable

import torch

from rltune.algos.checks import check_real

K3_LOG_RATIO_BOUND = 20.0
"""k3 clamps ``log_ratio`` to ``[-20, 20]`` before the exponential: ``exp(20) ~ 4.9e8``
is finite in fp32 and bf16, while an unclamped ``exp(-log_ratio)`` overflows to inf for
``log_ratio < -88`` in fp32 (padding positions, a diverged policy). Outside the bound the
gradient is 0."""


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio * log_ratio


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    lr = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.exp(-lr) - 1.0 + lr


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, kind: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || ref)``; ``[B, T]`` in, ``[B, T]`` out.

    ``logprobs`` are the policy's log-probs of the sampled tokens, ``ref_logprobs`` the
    reference model's. Unreduced: the caller masks and aggregates (``masked_mean``).
    Gradients flow into both arguments; detach ``ref_logprobs`` upstream as usual.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: kind={kind!r}; expected one of {sorted(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs {tuple(logprobs.shape)} and ref_logprobs "
            f"{tuple(ref_logprobs.shape)} differ in shape"
        )
    return KL_ESTIMATORS[kind](logprobs - ref_logprobs)


def adaptive_kl_coef(
    coef: float,
    observed_kl: float | torch.Tensor,
    *,
    target: float,
    horizon: float,
    n_steps: int,
) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019).

    A proportional controller that steers the observed KL to ``target``::

        err      = clip(observed_kl / target - 1, -0.2, 0.2)
        next_coef = coef * (1 + err * n_steps / horizon)

    ``n_steps`` is the number of samples (or steps, in the units of ``horizon``) since the
    last update; ``horizon`` sets how fast the coefficient moves (the paper's 10,000).
    The clip bounds a single update to a factor ``1 +- 0.2 * n_steps / horizon``.
    Deviation: the result is floored at 0, since for ``n_steps > 5 * horizon`` that
    factor would turn the coefficient negative (a reward for drifting away).
    ``observed_kl`` may be a one-element tensor; it is read once (the coefficient is a
    host-side decision). Every argument must be finite; ``coef`` and ``n_steps`` >= 0,
    ``target`` and ``horizon`` > 0. Returns a float.
    """
    caller = "adaptive_kl_coef"
    if isinstance(observed_kl, torch.Tensor):
        if observed_kl.numel() != 1:
            raise ValueError(
                f"{caller}: observed_kl has shape {tuple(observed_kl.shape)}; expected one "
                f"number (the batch's mean KL per sequence)"
            )
        observed_kl = observed_kl.item()
    kl = check_real(observed_kl, "observed_kl", caller)
    for name, value in (("coef", coef), ("n_steps", n_steps)):
        if check_real(value, name, caller) < 0:
            raise ValueError(f"{caller}: {name}={value} must be >= 0")
    for name, value in (("target", target), ("horizon", horizon)):
        if not check_real(value, name, caller) > 0:
            raise ValueError(f"{caller}: {name}={value} must be > 0")
    err = min(max(kl / target - 1.0, -0.2), 0.2)
    return max(0.0, coef * (1.0 + err * n_steps / horizon))
