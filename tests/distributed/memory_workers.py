"""What each rank of the activation-checkpointing and offload group tests runs (the
processes import this module by name: importable top-level functions only). The learner
is the layout harness's (``layout_workers``: GRPO with a KL term, micro-batch budget,
clip, Adam eps=1e-3) with ``train`` keys added."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from layout_workers import global_batch, run_steps
from learner_group_workers import ADAM_EPS, BUDGET, GRAD_CLIP, LR, algo_config

from rltune.algos import ALGORITHMS
from rltune.config.schema import TrainConfig
from rltune.learner.distributed import shard_batch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.learner.memory import is_checkpointed
from rltune.learner.parallel import Parallelism, make_parallelism
from rltune.models.load import load_model, resolve_model
from rltune.parallel.layout import Layout
from rltune.parallel.strategy import MeshParallelism


def build_learner(model: torch.nn.Module, parallelism: Parallelism, train: dict[str, Any]) -> LocalLearner:
    """The harness's learner with the ``train`` keys of the run."""
    objective = build_objective(ALGORITHMS["grpo"], algo_config())
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET, **train)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return learner


def offloaded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 holds ``model``'s shards with a CPU offload policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    state = model._get_fsdp_state()
    group = state._fsdp_param_group
    return group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)


def memory_runs(model_path: str, runs: list[tuple[str, Any, dict[str, Any]]], seed: int = 0,
                steps: int = 2) -> list[dict[str, Any]]:
    """One rank: for each ``(strategy, layout, train)`` of ``runs`` (``strategy`` ``ddp``
    or ``fsdp2``, or ``mesh`` with a ``Layout`` dict), ``steps`` steps on this rank's data
    shard; the harness's result, plus how many blocks are checkpointed and whether the
    shards are offloaded."""
    torch.set_num_threads(1)
    model_dir = resolve_model(model_path)
    batch = global_batch(model_dir, seed)
    out = []
    for strategy, layout, train in runs:
        parallelism = MeshParallelism(Layout(**layout)) if strategy == "mesh" else make_parallelism(strategy)
        learner = build_learner(load_model(model_dir), parallelism, train)
        shard = shard_batch(batch, parallelism.rank, parallelism.world, unit=learner.objective.unit)
        result = run_steps(learner, shard, steps)
        # FSDP2 renames the blocks' classes (FSDPQwen2DecoderLayer): count over every module
        result["checkpointed"] = sum(is_checkpointed(m) for m in learner.model.modules())
        result["offloaded"] = hasattr(learner.model, "_get_fsdp_state") and offloaded(learner.model)
        out.append(result)
    return out


def refused(model_path: str, cases: list[tuple[str, Any, dict[str, Any]]]) -> list[str]:
    """One rank: for each ``(strategy, layout, train)``, the error building the learner
    raises (empty when none)."""
    torch.set_num_threads(1)
    model = load_model(resolve_model(model_path))
    messages = []
    for strategy, layout, train in cases:
        parallelism = MeshParallelism(Layout(**layout)) if strategy == "mesh" else make_parallelism(strategy)
        try:
            build_learner(copy.deepcopy(model), parallelism, train)
            messages.append("")
        except ValueError as err:
            messages.append(str(err))
    return messages


def offload_resume(model_path: str, directory: str) -> dict[str, Any]:
    """One rank: FSDP2 with offloaded shards takes a step, writes a sharded checkpoint
    and takes a second step; a fresh learner built alike loads the checkpoint and takes
    the second step too. Returns both second steps' weights and where the optimizer's
    state lives."""
    from rltune.checkpoint.sharded import load_sharded, save_sharded

    model_dir = resolve_model(model_path)
    batch = global_batch(model_dir, 0)
    weights, devices = [], []
    for resumed in (False, True):
        learner = build_learner(load_model(model_dir), make_parallelism("fsdp2"), {"offload": "params"})
        shard = shard_batch(batch, learner.parallelism.rank, learner.parallelism.world, unit=learner.objective.unit)
        if resumed:
            load_sharded(learner.model, learner.optimizer, Path(directory), meta)
        else:
            learner.step(shard)
            meta = save_sharded(learner.model, learner.optimizer, Path(directory))
        learner.step(shard)
        weights.append({k: v.clone() for k, v in learner.export_weights().items()})
        devices.append(sorted({v.device.type for s in learner.optimizer.state.values()
                               for v in s.values() if isinstance(v, torch.Tensor)}))
    return {"straight": weights[0], "resumed": weights[1], "state_devices": devices}


def runs_and_refusals(model_path: str, runs: list, cases: list) -> dict[str, Any]:
    """One rank: :func:`memory_runs` and :func:`refused` in one process start."""
    return {"runs": memory_runs(model_path, runs), "refused": refused(model_path, cases)}


def runs_and_resume(model_path: str, runs: list, directory: str) -> dict[str, Any]:
    """One rank: :func:`memory_runs` and :func:`offload_resume` in one process start."""
    return {"runs": memory_runs(model_path, runs), "resume": offload_resume(model_path, directory)}
