"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from functools import partial

import torch

from rltune.config.schema import TrainConfig
from rltune.learner.memory import HostOffloadAdamW


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the fused kernel (one pass over all
    parameters; on CPU about 6x faster than the multi-tensor one for small models)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters")
    if cfg.offload == "optimizer":  # the moments and the step on the host (rltune/learner/memory.py)
        return HostOffloadAdamW(trainable, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=True,
    )


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based).

    Linear warm-up from ``1/(warmup+1)`` to 1 over ``warmup`` steps, then constant, or a
    cosine from 1 down to ``min_ratio`` at ``total`` steps.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_schedule(
    opt: torch.optim.Optimizer, cfg: TrainConfig, *, updates_per_step: int = 1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_factor`, stepped once per optimizer update.
    ``updates_per_step`` (PPO epochs x mini-batches) keeps ``train.warmup_steps`` and
    ``train.steps`` counted in train steps. Its state is just the update count, so it
    round-trips through JSON."""
    fn = partial(
        lr_factor,
        warmup=cfg.warmup_steps * updates_per_step,
        total=cfg.steps * updates_per_step,
        schedule=cfg.schedule,
        min_ratio=cfg.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)
