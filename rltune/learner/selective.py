"""Selective backprop (``algo.skip_zero_advantage``): which rows of a step's batch the
learner runs forward and backward, given the batch's advantages.

A row whose advantage is zero at every token it trains on (every sample of a group with
no reward spread, or a row with nothing in its loss mask) contributes exactly zero to the
policy-gradient loss and to its gradient: each token's loss is ``-A * r`` (clipped,
dual-clipped, importance-weighted: all multiples of ``A``), and ``A = 0`` makes it ``0``
whatever the weights. Running such a row costs a forward and a backward for nothing.

The update stays the full batch's because the learner keeps two things of the whole
batch (:meth:`rltune.learner.learner.LocalLearner.step`):

* **the denominator**: ``objective.denominator`` of the *whole* batch (its tokens for
  token-mean, its rows for the seq-mean modes), agreed over the group as before, so each
  kept row's loss is divided by what it would have been divided by;
* **a gradient on every rank**: a rank all of whose rows are skipped still runs one
  forward and backward, of its first unit of rows (whose gradient is exactly zero). So its
  parameters get zero gradients (not none: AdamW skips a parameter whose gradient is None,
  and would then not decay its moments as the full batch's step does), DDP's gradient
  exchange and FSDP2's gathers still meet the other ranks', and its step reports the same
  metric names as theirs.

It is exact only when nothing else in the loss depends on the weights through a skipped
row: a KL-to-reference term in the loss, a supervised or preference objective, or an MoE
router loss (computed over every routed token of the micro-batch) would all change. The
config refuses those combinations (:func:`rltune.algos.registry.config_problems`, and the
learner for a model whose own router loss coefficient is on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltune.data.records import TrainBatch
from rltune.metrics import keys
from rltune.metrics.types import Mean, Metric


@dataclass(frozen=True)
class Selection:
    """The rows of a batch that the learner runs, and how many it left out."""

    rows: TrainBatch
    """The rows to run forward and backward (the batch itself when none is skipped)."""
    skipped: int
    """How many of the batch's rows are not run."""
    total: int
    """How many rows the batch has."""

    def metrics(self) -> dict[str, Metric]:
        """``learn/skipped_frac``: the share of the batch's rows not run, weighted by the
        rows, so a group's mean is the share of all its rows."""
        return {keys.LEARN_SKIPPED_FRAC: Mean(self.skipped / self.total, float(self.total))}


def trained_rows(batch: TrainBatch, unit: int = 1) -> torch.Tensor:
    """``[B // unit]`` bool: whether each unit of ``unit`` consecutive rows has a token in
    its loss mask with a non-zero advantage (a NaN or infinite advantage counts as
    non-zero, so the non-finite guard still sees it)."""
    if batch.advantages is None:
        raise ValueError(
            "algo.skip_zero_advantage: the learner got a batch without advantages; only "
            "policy-gradient objectives (online algorithms) can skip rows by their advantage"
        )
    if len(batch) % unit:
        raise ValueError(f"algo.skip_zero_advantage: {len(batch)} rows do not split into units of {unit}")
    advantages = batch.advantages
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    live = ((advantages != 0) & (batch.loss_mask != 0)).any(dim=1)
    return live.view(-1, unit).any(dim=1)


def select_rows(batch: TrainBatch, unit: int = 1) -> Selection:
    """The rows of ``batch`` to run (module docstring): the units with a non-zero
    advantage, in their order, or the first unit when there is none. One host sync (the
    count of kept units decides the shapes)."""
    live = trained_rows(batch, unit)
    units = live.nonzero().flatten().tolist()
    if len(units) == len(live):
        return Selection(batch, 0, len(batch))
    if not units:
        units = [0]
    index = torch.tensor([u * unit + k for u in units for k in range(unit)], device=batch.input_ids.device)
    return Selection(batch.select(index), len(batch) - len(index), len(batch))
