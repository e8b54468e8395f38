"""What each rank of the fp16 learner-group test runs (imported by name in the spawned
processes: top-level functions only)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from learner_group_workers import ADAM_EPS, BUDGET, GRAD_CLIP, LR, PerShardDenominator, algo_config

from rltune.algos import ALGORITHMS
from rltune.config.schema import TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.distributed import shard_batch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import Parallelism, make_parallelism
from rltune.metrics.types import scalars
from rltune.models.load import load_model
from rltune.parallel.layout import Layout
from rltune.parallel.strategy import MeshParallelism
from rltune.runtime.ray.fsdp_state import rank_checkpoint_state, rank_load_checkpoint_state
from rltune.runtime.ray.learner_layout import MESH


def fp16_learner(model: torch.nn.Module, parallelism: Parallelism | None = None) -> LocalLearner:
    """The learner-group tests' learner (objective, budget, clip, Adam eps) in fp16."""
    objective = build_objective(ALGORITHMS["grpo"], algo_config())
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET, precision="fp16")
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return learner


def blown_up(batch: TrainBatch) -> TrainBatch:
    """``batch`` with its advantages times 1e6: the scaled fp16 backward overflows (on
    every shard of a group)."""
    return dataclasses.replace(batch, advantages=batch.advantages * 1e6)


def three_steps(learner: LocalLearner, batch: TrainBatch, overflow: TrainBatch) -> dict:
    """A step, an overflowing step (skipped), a step: the metrics of each and the full
    weights at the end."""
    metrics = [scalars(learner.step(b)) for b in (batch, overflow, batch)]
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in learner.export_weights().items()},
            "version": learner.version}


def fp16_group_run(model_dir: str, batch: TrainBatch, names: tuple[str, ...]) -> dict:
    """One rank: :func:`three_steps` on its shard for each of ``names``: ``ddp``,
    ``fsdp2``, ``control`` (DDP with the per-shard denominator)."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard, overflow = shard_batch(batch, rank, world), shard_batch(blown_up(batch), rank, world)
    makers = {"ddp": lambda: make_parallelism("ddp"), "fsdp2": lambda: make_parallelism("fsdp2"),
              "control": PerShardDenominator}
    return {name: three_steps(fp16_learner(load_model(model_dir), makers[name]()), shard, overflow)
            for name in names}


def fp16_mesh_run(model_path: str, layout: dict) -> dict:
    """One rank of a ``Layout(**layout)`` group (tensor or expert parallelism) in fp16:
    :func:`three_steps` on its data shard of the fixed batch of ``model_path``."""
    from rltune.models.load import resolve_model
    from rltune.parallel.layout import Layout
    from rltune.parallel.strategy import MeshParallelism

    from learner_group_workers import make_batch

    torch.set_num_threads(1)
    model_dir = resolve_model(model_path)
    batch = make_batch(load_model(model_dir))
    parallelism = MeshParallelism(Layout(**layout))
    learner = fp16_learner(load_model(model_dir), parallelism)
    shard = shard_batch(batch, parallelism.rank, parallelism.world)
    overflow = shard_batch(blown_up(batch), parallelism.rank, parallelism.world)
    return three_steps(learner, shard, overflow)


def fp16_reference(model_path: str) -> dict:
    """One fp16 process on the whole fixed batch of ``model_path``."""
    from rltune.models.load import resolve_model

    from learner_group_workers import make_batch

    model_dir = resolve_model(model_path)
    batch = make_batch(load_model(model_dir))
    return three_steps(fp16_learner(load_model(model_dir)), batch, blown_up(batch))



def fp16_resume(model_dir: str, batch: TrainBatch, layout: str, directory: str) -> dict:
    """One rank of a two-rank fp16 group, ``layout`` ``fsdp2`` (the FSDP2 strategy,
    whose checkpoint is gathered into one file on rank 0) or ``dp_shard`` (FSDP2 over a
    device mesh, which writes DCP shards into ``directory``): a step and an overflowing
    one (the scale halved, one overflow counted), a checkpoint written and read as the
    Ray learner group does (``rank_checkpoint_state``, ``rank_load_checkpoint_state``),
    then one more step; a fresh group loads the checkpoint and takes that step; a
    control loads it without the scaler's state."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard, overflow = shard_batch(batch, rank, world), shard_batch(blown_up(batch), rank, world)

    def build() -> LocalLearner:
        parallelism = make_parallelism("fsdp2") if layout == "fsdp2" else MeshParallelism(Layout(dp_shard=2))
        return fp16_learner(load_model(model_dir), parallelism)

    def weights(learner: LocalLearner) -> dict:
        return {k: v.clone() for k, v in learner.export_weights().items()}

    first = build()
    before = [scalars(first.step(b)) for b in (shard, overflow)]
    # rank 0 gets the state (the driver's part in a Ray run) and keeps its own objects;
    # every other rank loads a copy of them
    strategy = "fsdp2" if layout == "fsdp2" else MESH
    state = [rank_checkpoint_state(first, strategy, "", directory)]
    dist.broadcast_object_list(state, src=0)
    tensors, meta = state[0]

    def load(learner: LocalLearner, meta: dict) -> None:
        rank_load_checkpoint_state(learner, strategy, tensors, meta, Path(directory), "")

    out = {"before": before, "meta": meta, "format": meta["model"], "uninterrupted": scalars(first.step(shard)),
           "uninterrupted_weights": weights(first), "state": first.precision.state_dict()}
    resumed = build()
    load(resumed, meta)
    out["loaded_state"] = resumed.precision.state_dict()
    out["resumed"] = scalars(resumed.step(shard))
    out["resumed_weights"] = weights(resumed)
    out["resumed_state"] = resumed.precision.state_dict()
    control = build()
    load(control, {**meta, "learner": {k: v for k, v in meta["learner"].items() if k != "precision"}})
    out["control"] = scalars(control.step(shard))
    return out
