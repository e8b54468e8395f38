"""Exact resume: 6 steps straight == 3 steps, save, fresh process state, load, 3 steps.

The toy run draws from every RNG a real run may use: dropout (torch's global RNG), a
shuffling ``torch.Generator`` for the data order, numpy noise on the targets and Python
``random`` for an augmentation coin; AdamW with a LambdaLR warm-up; a data cursor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from rltune.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    optimizer_from_state,
    optimizer_to_state,
    rng_from_state,
    rng_to_state,
    save_checkpoint,
    scheduler_from_state,
    scheduler_to_state,
)

N_ROWS, BATCH = 10, 4  # 10 rows in batches of 4: an epoch boundary falls mid-run


def _warmup(epoch: int) -> float:
    return min(1.0, (epoch + 1) / 3)


@dataclass
class _Run:
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: LambdaLR
    data_gen: torch.Generator
    order: torch.Tensor
    cursor: int
    step: int


def _fresh_run(seed: int) -> _Run:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.05)
    sched = LambdaLR(opt, _warmup)
    data_gen = torch.Generator().manual_seed(seed + 1)
    return _Run(model, opt, sched, data_gen, torch.randperm(N_ROWS, generator=data_gen), 0, 0)


def _train(run: _Run, steps: int) -> None:
    x_all = torch.linspace(-1, 1, N_ROWS * 3).reshape(N_ROWS, 3)
    y_all = x_all.sum(dim=1, keepdim=True)
    for _ in range(steps):
        rows = []
        while len(rows) < BATCH:
            if run.cursor == N_ROWS:  # new epoch, new order
                run.order, run.cursor = torch.randperm(N_ROWS, generator=run.data_gen), 0
            rows.append(int(run.order[run.cursor]))
            run.cursor += 1
        sign = -1.0 if random.random() < 0.5 else 1.0  # a mirrored copy of the batch
        noise = torch.from_numpy(np.random.normal(scale=0.1, size=(BATCH, 1))).float()
        x, y = sign * x_all[rows], sign * y_all[rows] + noise
        run.opt.zero_grad()
        ((run.model(x) - y) ** 2).mean().backward()
        run.opt.step()
        run.sched.step()
        run.step += 1


def _save(run: _Run, root: Path) -> None:
    opt_tensors, opt_meta = optimizer_to_state(run.opt)
    rng_tensors, rng_meta = rng_to_state({"data": run.data_gen})
    meta = {
        "step": run.step,
        "data": {"cursor": run.cursor},
        "optimizer": opt_meta,
        "scheduler": scheduler_to_state(run.sched),
        "rng": rng_meta,
    }
    tensors = {"model": run.model.state_dict(), "optimizer": opt_tensors, "rng": rng_tensors, "data": {"order": run.order}}
    save_checkpoint(root, run.step, tensors=tensors, meta=meta, keep=2)


def _resume(root: Path, *, restore_rng: bool = True) -> _Run:
    run = _fresh_run(seed=12345)  # everything different until the checkpoint is loaded
    path = latest_checkpoint(root)
    assert path is not None
    tensors, meta = load_checkpoint(path)
    run.model.load_state_dict(tensors["model"], strict=True)
    optimizer_from_state(run.opt, tensors["optimizer"], meta["optimizer"])
    scheduler_from_state(run.sched, meta["scheduler"])
    if restore_rng:
        rng_from_state(tensors["rng"], meta["rng"], {"data": run.data_gen})
    run.order, run.cursor, run.step = tensors["data"]["order"], meta["data"]["cursor"], meta["step"]
    return run


def _params(run: _Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def test_resume_is_bitwise_identical(tmp_path):
    straight = _fresh_run(seed=0)
    _train(straight, 6)

    first = _fresh_run(seed=0)
    _train(first, 3)
    _save(first, tmp_path)
    _train(first, 1)  # work done after the checkpoint is lost with the "crash"
    del first

    resumed = _resume(tmp_path)
    assert resumed.step == 3
    _train(resumed, 3)
    assert resumed.step == 6
    assert resumed.opt.param_groups[0]["lr"] == straight.opt.param_groups[0]["lr"]
    for a, b in zip(_params(straight), _params(resumed)):
        assert torch.equal(a, b)


def test_resume_without_rng_state_diverges(tmp_path):
    """Control: the comparison above is sensitive to a single RNG left unrestored."""
    straight = _fresh_run(seed=0)
    _train(straight, 6)
    first = _fresh_run(seed=0)
    _train(first, 3)
    _save(first, tmp_path)

    resumed = _resume(tmp_path, restore_rng=False)
    _train(resumed, 3)
    assert not all(torch.equal(a, b) for a, b in zip(_params(straight), _params(resumed)))
