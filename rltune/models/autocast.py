"""The autocast context of each numeric precision, shared by the learner
(``train.precision``, :mod:`rltune.learner.precision`) and the generators
(``rollout.precision``), so that both compute in the same arithmetic."""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The autocast dtype of each precision that has one (fp8: bf16 around the float8 linears)."""


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device_type`` (a null one for fp32)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


__all__ = ["AUTOCAST_DTYPES", "autocast_for"]
