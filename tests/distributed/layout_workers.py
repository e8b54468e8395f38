"""The layout equivalence harness: a learner group of any layout
(``rltune.parallel.layout.Layout``) against one process on the whole batch.

``two_steps`` runs in every rank of a group started by
``rltune.learner.launch.spawn_learner_group(layout_world, two_steps, ...)``;
``reference`` runs in the test process. Both build the model from the same directory,
the same global batch (``learner_group_workers.make_batch``, seeded) and the same
learner (GRPO with a KL term, the micro-batch budget, clip and Adam eps of
``learner_group_workers``: see there why eps=1e-3), then take ``steps`` optimizer steps,
and return ``{"loss": [...], "grad_norm": [...], "metrics": [...], "params": {name: full
tensor}}`` (the params after the last step, gathered to full tensors on every rank).

A group rank trains on its DATA shard: ``shard_batch(batch, data_rank, data_world)``;
tp and pp peers take the same rows.
"""

from __future__ import annotations

from typing import Any

import torch
from learner_group_workers import ADAM_EPS, BUDGET, GRAD_CLIP, LR, algo_config, make_batch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.learner.distributed import shard_batch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import NoParallelism, Parallelism
from rltune.metrics.types import scalars
from rltune.models.load import load_model, resolve_model
from rltune.parallel.layout import Layout
from rltune.parallel.strategy import MeshParallelism


def build_learner(model: torch.nn.Module, parallelism: Parallelism, algo: str = "grpo") -> LocalLearner:
    """The harness's learner: ``algo`` (GRPO: token-mean with a k3 KL term), lr, clip and
    micro-batch budget of ``learner_group_workers``, Adam eps=1e-3."""
    config = algo_config() if algo == "grpo" else AlgoConfig(name=algo)
    objective = build_objective(ALGORITHMS[algo], config)
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return learner


def global_batch(model_dir: str, seed: int):
    """The fixed global batch of ``seed``, its old and reference log-probs from the
    model as loaded (the same on every rank: single-threaded, the same weights)."""
    return make_batch(load_model(model_dir), seed=seed)


def run_steps(learner: LocalLearner, batch, steps: int) -> dict[str, Any]:
    """``steps`` optimizer steps on ``batch``; the harness's result dict."""
    out: dict[str, Any] = {"loss": [], "grad_norm": [], "metrics": []}
    for _ in range(steps):
        metrics = scalars(learner.step(batch))
        out["metrics"].append(metrics)
        out["loss"].append(metrics["loss"])
        out["grad_norm"].append(metrics["grad_norm"])
    out["params"] = {k: v.detach().cpu().clone() for k, v in learner.export_weights().items()}
    return out


def two_steps(model_path: str, layout: dict, seed: int = 0, steps: int = 2, algo: str = "grpo",
              parallelism_factory: Any = None) -> dict[str, Any]:
    """One rank of a group of ``Layout(**layout)``: its data shard of the global batch,
    ``steps`` steps with :class:`MeshParallelism`. ``parallelism_factory`` (a test's
    control): called with the layout instead of ``MeshParallelism``."""
    torch.set_num_threads(1)
    model_dir = resolve_model(model_path)
    batch = global_batch(model_dir, seed)
    factory = parallelism_factory if parallelism_factory is not None else MeshParallelism
    parallelism = factory(Layout(**layout))
    learner = build_learner(load_model(model_dir), parallelism, algo)
    shard = shard_batch(batch, parallelism.rank, parallelism.world, unit=learner.objective.unit)
    out = run_steps(learner, shard, steps)
    out["data_rank"], out["data_world"] = parallelism.rank, parallelism.world
    return out


def reference(model_path: str, seed: int = 0, steps: int = 2, algo: str = "grpo") -> dict[str, Any]:
    """One process, :class:`NoParallelism`, the whole batch: what every layout must equal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_dir = resolve_model(model_path)
        batch = global_batch(model_dir, seed)
        return run_steps(build_learner(load_model(model_dir), NoParallelism(), algo), batch, steps)
    finally:
        torch.set_num_threads(threads)


class LocalDenominator(MeshParallelism):
    """Control (a real mistake): each data rank divides its losses by its own shard's
    denominator, while FSDP2 averages the ranks' gradients: a mean of shard means, not
    the batch's mean."""

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None):
        plan = super().agree(rows, forwards, denominator)
        return type(plan)(denominator, plan.forwards)


CONTROLS = {"local_denominator": LocalDenominator}
"""Named controls for :func:`several` (a class is not passed between processes by name)."""


def several(model_path: str, runs: list[tuple[dict, str | None]], seed: int = 0, steps: int = 2) -> list[dict]:
    """One rank: :func:`two_steps` for each ``(layout, control)`` of ``runs`` in turn, in
    the same group (one process start for several layouts of the same world); ``control``
    None or a key of :data:`CONTROLS`."""
    return [two_steps(model_path, layout, seed, steps, parallelism_factory=CONTROLS.get(control))
            for layout, control in runs]


def mesh_positions(layouts: list[dict]) -> list[dict]:
    """One rank: for each layout, what the mesh helpers say about this rank (its data
    rank and world, the shapes of the dense and expert data-parallel meshes)."""
    from rltune.parallel.mesh import build_mesh, data_rank, data_world, dense_dp_mesh, expert_dp_mesh

    out = []
    for layout in layouts:
        mesh = build_mesh(Layout(**layout), "cpu")
        dense, experts = dense_dp_mesh(mesh), expert_dp_mesh(mesh)
        out.append({"data_rank": data_rank(mesh), "data_world": data_world(mesh),
                    "dense": None if dense is None else list(dense.shape),
                    "experts": None if experts is None else list(experts.shape),
                    "tp_rank": mesh["tp"].get_local_rank()})
    return out
