"""Masked reductions over padded tensors.

A mask is 1 (or True) on entries that count and 0 elsewhere; fractional weights are
allowed and act as weights. Entries where the mask is 0 never reach the result, even when
they hold NaN or inf (padding positions often do), and they receive zero gradient.

An empty mask (nothing counted) reduces to 0 rather than NaN: a micro-batch whose rows are
all padding must add nothing to the loss instead of poisoning it.
"""

from __future__ import annotations

import torch

from rltune.algos.checks import check_real, result_dtype, stat_dtype

Dim = int | tuple[int, ...] | None


def _masked_terms(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * mask, mask)`` broadcast to one shape, with masked-out entries exactly 0.

    ``torch.where`` rather than a plain product so that a NaN/inf in a masked-out entry
    does not turn into NaN (``nan * 0 == nan``).
    """
    x, m = torch.broadcast_tensors(x, mask.to(x.dtype))
    keep = m != 0
    return torch.where(keep, x * m, torch.zeros_like(x)), m


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` elementwise, with 0 where ``den == 0`` (no NaN, no host sync)."""
    zero = den == 0
    safe_den = torch.where(zero, torch.ones_like(den), den)
    return torch.where(zero, torch.zeros_like(num), num / safe_den)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all dims when None).

    Shapes: ``x`` and ``mask`` broadcast together; the result drops ``dim``.
    """
    terms, _ = _masked_terms(x, mask)
    return terms.sum() if dim is None else terms.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim`` (all dims when None).

    A slice whose mask sums to 0 gives 0, not NaN (see the module docstring).
    """
    terms, m = _masked_terms(x, mask)
    if dim is None:
        return safe_divide(terms.sum(), m.sum())
    return safe_divide(terms.sum(dim=dim), m.sum(dim=dim))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Standardise ``x`` with statistics taken over the masked entries only.

    ``mu = masked_mean(x)``, ``var = masked_mean((x - mu)^2)`` (the population variance,
    ``unbiased=False``: whitening is a normalisation of the batch at hand, not an estimate
    of a population parameter, and it stays defined for a single entry), then
    ``(x - mu) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back, so
    only the scale changes (as in TRL's ``masked_whiten``).

    Entries where the mask is 0 are returned as 0, so padding never carries NaN onward.
    An empty mask returns all zeros. ``eps`` must be finite and >= 0; with ``eps=0`` a
    constant input (``var = 0``) gives 0, not ``0 / 0``. The statistics are computed in
    float32 (float64 for float64 input), so half-precision input does not overflow; the
    result has ``x``'s dtype when it is floating, else the default float dtype.
    """
    if not check_real(eps, "eps", "masked_whiten") >= 0:
        raise ValueError(f"masked_whiten: eps={eps} must be >= 0 (a negative one gives NaN)")
    out_dtype = result_dtype(x.dtype)
    x = x.to(stat_dtype(x.dtype))
    mean = masked_mean(x, mask)
    centred = x - mean
    var = masked_mean(centred * centred, mask)
    # var + eps == 0 only for eps=0 and a constant input, whose centred values are 0
    den = var + eps
    positive = den > 0
    out = centred * torch.where(positive, torch.rsqrt(torch.where(positive, den, torch.ones_like(den))),
                                torch.zeros_like(den))
    if not shift_mean:
        out = out + mean
    out, m = torch.broadcast_tensors(out, mask.to(x.dtype))
    return torch.where(m != 0, out, torch.zeros_like(out)).to(out_dtype)
