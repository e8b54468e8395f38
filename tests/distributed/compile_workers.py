"""What each rank of the compiled learner-group test runs (the spawned processes import
this module by name, so it holds only importable top-level functions)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from learner_group_workers import ADAM_EPS, BUDGET, GRAD_CLIP, LR

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.compiled import compile_blocks, compiled_graphs
from rltune.learner.distributed import shard_batch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import Parallelism, make_parallelism
from rltune.metrics.types import scalars
from rltune.models.load import load_model


def compile_learner(model: torch.nn.Module, compile_: bool, parallelism: Parallelism | None = None,
                    backend: str = "inductor") -> LocalLearner:
    """GRPO without KL, the group tests' budget, clip, lr and Adam eps; ``train.compile``
    as given, the blocks compiled first with ``backend`` (the learner leaves compiled
    blocks as they are)."""
    if compile_:
        compile_blocks(model, backend=backend)
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    cfg = TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET, compile=compile_)
    learner = LocalLearner(model, objective, cfg, parallelism=parallelism)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return learner


def compiled_group_run(model_dir: str, batch: TrainBatch, backend: str) -> dict:
    """One rank on its shard of ``batch``: two compiled steps with DDP and with FSDP2; the
    full weights after each, and how many graphs dynamo compiled."""
    torch.set_num_threads(1)
    shard = shard_batch(batch, dist.get_rank(), dist.get_world_size())
    out: dict = {}
    for strategy in ("ddp", "fsdp2"):
        learner = compile_learner(load_model(model_dir), True, make_parallelism(strategy), backend)
        out[strategy] = []
        for _ in range(2):
            metrics = scalars(learner.step(shard))
            out[strategy].append({"loss": metrics["loss"],
                                  "weights": {k: v.clone() for k, v in learner.export_weights().items()}})
    out["graphs"] = compiled_graphs()
    return out
