"""What each rank of the routing-replay group test runs (importable top-level functions)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rltune.learner.distributed import shard_batch
from rltune.learner.parallel import make_parallelism
from rltune.metrics.types import scalars
from rltune.models.load import load_model
from rltune.models.routing import find_routers, install_routing
from learner_group_workers import make_learner

BIAS_RATE = 0.01


def replay_model(model_dir: str) -> torch.nn.Module:
    """The MoE model installed with replay and aux-free bias, its routers then perturbed
    (the same way on every rank) so that the learner's own choice differs from the
    recorded routes and replay changes the result."""
    model = load_model(model_dir)
    install_routing(model, replay=True, aux_free_bias=BIAS_RATE)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for gate in find_routers(model):
            gate.weight.add_(0.5 * gate.weight.std() * torch.randn(gate.weight.shape, generator=g))
    return model


def one_step(model: torch.nn.Module, batch, parallelism=None) -> dict:
    """One learner step; its scalar metrics, full weights and routing biases."""
    learner = make_learner(model, parallelism)
    metrics = scalars(learner.step(batch))
    weights = {k: v.clone() for k, v in learner.export_weights().items()}
    bias = torch.stack([g.routing_bias.detach().clone() for g in find_routers(learner.model)])
    return {"metrics": metrics, "weights": weights, "bias": bias}


def group_replay(model_dir: str, batch) -> dict:
    torch.set_num_threads(1)
    shard = shard_batch(batch, dist.get_rank(), dist.get_world_size())
    return {s: one_step(replay_model(model_dir), shard, make_parallelism(s)) for s in ("ddp", "fsdp2")}
