"""How the Ray learner group (``rltune/runtime/ray/learner.py``) follows the learner
layout (``train.parallel``, ``rltune/parallel/layout.py``).

* Each actor builds its :class:`~rltune.learner.parallel.Parallelism` with
  :func:`learner_parallelism`: a config that sets nothing under ``train.parallel`` keeps
  the DDP or FSDP2 strategy of ``runtime.placement.learner_strategy`` (the same classes,
  checkpoints and results as before the mesh existed); any key set there gives a
  :class:`~rltune.parallel.strategy.MeshParallelism` of the layout.
* Each actor reports its :class:`Position` in the mesh: which shard of the global batch
  it trains on (its DATA rank: tp and pp peers share one) and whether its outputs
  (log-probs) are the model's (the last pipeline stage's are). The driver asks the actors
  once and then cuts and reassembles batches by data rank (:func:`data_shards`,
  :func:`output_actors`), with no rank arithmetic of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import ray
import torch

from rltune.data.records import TrainBatch
from rltune.learner.distributed import shard_batch
from rltune.learner.parallel import Parallelism, make_parallelism
from rltune.parallel.layout import check_layout, layout_for, model_config_of

if TYPE_CHECKING:
    from rltune.learner.learner import LocalLearner

MESH = "mesh"
"""The strategy name of a group laid out by ``train.parallel`` (every rank holds a part
of the model: every rank takes part in gathering it)."""


@dataclass(frozen=True)
class Position:
    """Where one actor sits in the learner mesh."""

    data_rank: int
    """The shard of each global batch it trains on."""
    data_world: int
    """How many shards each global batch is cut into."""
    holds_outputs: bool
    """Whether its log-probs are the model's (False on pipeline stages but the last)."""


def group_strategy(cfg: Any, world: int, model_dir: str) -> str:
    """``ddp`` or ``fsdp2`` (nothing set under ``train.parallel``), else :data:`MESH`
    after checking the layout against ``world`` ranks and the model's config (a
    :class:`~rltune.parallel.layout.LayoutError` before any actor starts)."""
    if not cfg.train.parallel.model_fields_set:
        return cfg.runtime.placement.learner_strategy
    check_layout(layout_for(cfg, world), world, model_config_of(model_dir))
    return MESH


def learner_parallelism(cfg: Any, world: int) -> tuple[Parallelism, str]:
    """One actor's parallelism and its strategy name (:func:`group_strategy`); every rank
    calls it together (a mesh's process groups are made here)."""
    if not cfg.train.parallel.model_fields_set:
        strategy = cfg.runtime.placement.learner_strategy
        return make_parallelism(strategy), strategy
    from rltune.parallel.strategy import MeshParallelism

    return MeshParallelism(check_layout(layout_for(cfg, world), world, None)), MESH


def position_of(parallelism: Parallelism) -> Position:
    """This actor's :class:`Position` (a parallelism's ``rank`` and ``world`` are its data
    rank and data world)."""
    mesh = getattr(parallelism, "mesh", None)
    if mesh is None:
        return Position(parallelism.rank, parallelism.world, True)
    from rltune.parallel.mesh import is_last_stage

    return Position(parallelism.rank, parallelism.world, is_last_stage(mesh))


def data_shards(batch: TrainBatch, positions: list[Position], unit: int) -> list[ray.ObjectRef]:
    """For each actor, a ref to its data rank's shard of ``batch`` (:func:`compact`, put
    into the object store once per data rank: tp and pp peers share the ref)."""
    world = positions[0].data_world
    refs = {rank: ray.put(compact(shard_batch(batch, rank, world, unit=unit))) for rank in range(world)}
    return [refs[p.data_rank] for p in positions]


def compact(batch: TrainBatch) -> TrainBatch:
    """``batch`` with each tensor in storage of its own: a shard's fields are views into
    the global batch, and pickling a view would ship the whole storage to every rank."""
    moved = {f.name: getattr(batch, f.name).clone() for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


def output_actors(positions: list[Position]) -> list[int]:
    """The index of one actor per data rank, in data-rank order, whose outputs are the
    model's: concatenating their answers gives the global batch's rows in order."""
    chosen: dict[int, int] = {}
    for index, position in enumerate(positions):
        if position.holds_outputs:
            chosen.setdefault(position.data_rank, index)
    missing = sorted(set(range(positions[0].data_world)) - chosen.keys())
    if missing:
        raise RuntimeError(f"learner group: no actor holds the outputs of data rank(s) {missing}; "
                           f"positions: {positions}")
    return [chosen[rank] for rank in sorted(chosen)]


def rank_logprobs(learner: LocalLearner, batch: TrainBatch) -> torch.Tensor:
    """``[B, C]`` log-probs of this rank's shard, on the CPU."""
    return learner.logprobs(batch).cpu()


__all__ = ["MESH", "Position", "compact", "data_shards", "group_strategy", "learner_parallelism", "output_actors",
           "position_of", "rank_logprobs"]
