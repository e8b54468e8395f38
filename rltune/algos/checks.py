"""Argument checks shared by the functions of ``rltune.algos``.

These functions run every training step, so a check looks at types, shapes, dtypes and
Python numbers only: it never reads a tensor's values (on an accelerator that would wait
for the device, a host sync). Value preconditions on tensors (a finite reward in a row
marked valid, a denominator tensor >= 0) are stated in the docstrings instead.
"""

from __future__ import annotations

import math

import torch


def check_int(value: object, name: str, caller: str, *, minimum: int) -> int:
    """``value`` as an ``int`` >= ``minimum``; a bool, a float or a tensor is refused
    (TypeError). Anything integral (``__index__``: a numpy integer too) counts as an int."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
        raise TypeError(f"{caller}: {name}={value!r} ({type(value).__name__}) must be an int")
    number = value.__index__()
    if number < minimum:
        raise ValueError(f"{caller}: {name}={number} must be >= {minimum}")
    return number


def check_real(value: object, name: str, caller: str) -> float:
    """``value`` as a finite ``float``; a bool, a tensor (reading it could be a host sync)
    or a non-number is refused (TypeError), NaN and +-inf too (ValueError)."""
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__float__"):
        raise TypeError(f"{caller}: {name}={value!r} ({type(value).__name__}) must be a number")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError(f"{caller}: {name}={value} must be finite")
    return number


def check_floating(caller: str, **tensors: torch.Tensor) -> None:
    """Each tensor must have a floating dtype (log-probs, values: an integer tensor would
    be truncated or refused deep inside torch)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise TypeError(f"{caller}: {name} has dtype {t.dtype}; expected a floating dtype")


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of a ``dtype`` tensor are computed in: float64 stays float64,
    everything else (half precision, integers, bool) becomes float32, where a sum of
    squares of rewards in the thousands does not overflow as it does in float16."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a result computed from a ``dtype`` tensor is returned in: the same for a
    floating dtype, the default float dtype for integers and bool."""
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def check_real_dtype(caller: str, **tensors: torch.Tensor) -> None:
    """Each tensor must hold real numbers (any integer, bool or floating dtype)."""
    for name, t in tensors.items():
        if t.is_complex():
            raise TypeError(f"{caller}: {name} has dtype {t.dtype}; expected a real dtype")


def denominator_tensor(
    denominator: float | torch.Tensor, like: torch.Tensor, caller: str
) -> torch.Tensor:
    """An explicit loss ``denominator`` as a 0-dim tensor of ``like``'s dtype and device.

    A Python number must be finite and > 0. A tensor must be 0-dim with a real dtype
    (``loss_denominator`` gives one); its value is not read, which on an accelerator would
    be a host sync every step. Precondition: it is >= 0, and 0 only when the whole batch
    has nothing masked in (then every numerator is 0 too and the loss is 0). A non-finite
    one gives a non-finite loss, which the learner's non-finite step guard skips.
    """
    if isinstance(denominator, torch.Tensor):
        if denominator.dim() != 0:
            raise ValueError(
                f"{caller}: denominator has shape {tuple(denominator.shape)}; expected a 0-dim "
                f"tensor or a number (the whole batch's normaliser, loss_denominator(mask, ...))"
            )
        if denominator.dtype == torch.bool or denominator.is_complex():
            raise TypeError(f"{caller}: denominator has dtype {denominator.dtype}; expected a real number")
        return denominator.to(dtype=like.dtype, device=like.device)
    value = check_real(denominator, "denominator", caller)
    if not value > 0:
        raise ValueError(
            f"{caller}: denominator={value} must be > 0 (only a 0-dim tensor may be 0: the "
            f"count of a whole batch with nothing masked in)"
        )
    return torch.tensor(value, dtype=like.dtype, device=like.device)
