"""What each rank of the selective-backprop group test runs (the spawned processes import
this module by name, so it holds only importable top-level functions)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from learner_group_workers import ADAM_EPS, BUDGET, GRAD_CLIP, LR, make_batch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.distributed import shard_batch
from rltune.learner.learner import LocalLearner
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.parallel import Parallelism, make_parallelism
from rltune.learner.objectives import build_objective
from rltune.learner.selective import select_rows
from rltune.metrics.types import scalars
from rltune.models.load import load_model

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
ZERO_ROWS = [4, 5, 6, 7]
"""Rows whose advantage is zeroed: all of rank 1's shard (rows 4-7), so rank 1 runs only
the zero-gradient row the learner keeps for it; rank 0 skips row 2 (nothing in its loss
mask) and runs the rest."""


def skip_batch(model: torch.nn.Module) -> TrainBatch:
    """The group tests' batch (tests/distributed/learner_group_workers.py) without the
    reference log-probs (a KL term in the loss is refused with skipping) and with the
    advantages of ``ZERO_ROWS`` zero."""
    batch = make_batch(model)
    advantages = batch.advantages.clone()
    advantages[ZERO_ROWS] = 0.0
    return replace(batch, advantages=advantages, ref_logprobs=None)


def skip_learner(model: torch.nn.Module, aggregation: str, skip: bool,
                 parallelism: Parallelism | None = None) -> LocalLearner:
    """GRPO without KL, the group tests' budget, clip, lr and Adam eps."""
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo", aggregation=aggregation))
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism, skip_zero_advantage=skip)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return learner


def two_steps(learner: LocalLearner, batch: TrainBatch) -> dict:
    """Two steps on ``batch``: the scalar metrics and the full weights after each."""
    out: dict = {"metrics": [], "weights": []}
    for _ in range(2):
        out["metrics"].append(scalars(learner.step(batch)))
        out["weights"].append({k: v.clone() for k, v in learner.export_weights().items()})
    return out


def skipping_group_run(model_dir: str, batch: TrainBatch) -> dict:
    """One rank on its shard of ``batch``, skipping: two steps with DDP and with FSDP2,
    for each aggregation; also how many micro-batches the rank runs."""
    torch.set_num_threads(1)
    shard = shard_batch(batch, dist.get_rank(), dist.get_world_size())
    out: dict = {"micro_batches": len(split_by_tokens(select_rows(shard).rows, BUDGET))}
    for strategy in ("ddp", "fsdp2"):
        for aggregation in AGGREGATIONS:
            learner = skip_learner(load_model(model_dir), aggregation, True, make_parallelism(strategy))
            out[f"{strategy}/{aggregation}"] = two_steps(learner, shard)
    return out
