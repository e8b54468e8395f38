"""A learner group's processes: joining and leaving the torch.distributed group, where a
rank computes, and which rows of each global batch it trains on.

Every process (rank) holds one :class:`~rltune.learner.learner.LocalLearner` with a
data-parallel strategy (:mod:`rltune.learner.parallel`: DDP or FSDP2) and receives its
own shard of each global batch (:func:`shard_batch`: contiguous blocks of rows); the
group's update is then the one a single learner makes on the whole batch.

Processes join the group through :func:`init_group` (the standard ``torchrun``
environment); :func:`rltune.learner.launch.spawn_learner_group` starts a group on this
machine without any launcher.
"""

from __future__ import annotations

import os
import socket
from dataclasses import fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from rltune.data.records import TrainBatch
from rltune.data.shards import shard_bounds

GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
"""The environment variables :func:`init_group` reads (``torchrun`` sets them)."""


# ----------------------------------------------------------------------------- the group


def default_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` when CUDA is available, else ``"gloo"``.

    On GPUs the model's collectives run on NCCL; CPU tensors (the step metrics that
    :func:`rltune.metrics.types.all_reduce` combines in float64) go through gloo, which a
    plain ``"nccl"`` group could not carry."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_group(backend: str | None = None, *, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group described by ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
    ``WORLD_SIZE``; returns ``(rank, world_size)``.

    ``backend`` None means :func:`default_backend`. A backend with NCCL binds this
    process to the GPU ``LOCAL_RANK`` names (the index among the processes of this
    machine), so no device index is ever fixed in code. ``timeout_s`` bounds how long a
    collective waits for the other ranks."""
    if dist.is_initialized():
        raise RuntimeError("init_group: this process already belongs to a process group; "
                           "call destroy_group() first")
    missing = [name for name in GROUP_ENV if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"init_group: environment variable(s) {', '.join(missing)} not set; start the "
            "processes with torchrun (or rltune.learner.launch.spawn_learner_group), "
            f"which sets {', '.join(GROUP_ENV)}"
        )
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if not 0 <= rank < world:
        raise RuntimeError(f"init_group: RANK={rank} is not in [0, WORLD_SIZE={world})")
    backend = backend or default_backend()
    device_id = None
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise RuntimeError(f"init_group: backend {backend!r} needs CUDA, which is not available; "
                               "use backend='gloo' on CPU")
        if not os.environ.get("LOCAL_RANK"):
            raise RuntimeError("init_group: the NCCL backend needs LOCAL_RANK (this process's GPU "
                               "index on its machine); torchrun sets it")
        device_id = torch.device("cuda", _env_int("LOCAL_RANK"))
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout_s), device_id=device_id,
    )
    return rank, world


def destroy_group() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def group_device() -> torch.device:
    """Where this rank computes: ``cuda:LOCAL_RANK`` when the group has an NCCL backend,
    else the CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", _env_int("LOCAL_RANK"))
    return torch.device("cpu")


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


# ----------------------------------------------------------------------------- sharding


def shard_batch(batch: TrainBatch, rank: int, world: int, *, unit: int = 1) -> TrainBatch:
    """``rank``'s shard of the global ``batch`` (rows :func:`shard_bounds`; views, the
    batch is not modified). Pass the objective's ``unit``."""
    start, stop = shard_bounds(len(batch), rank, world, unit=unit)
    return batch.select(slice(start, stop))


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """``batch`` with every tensor on ``device`` (itself when they already are)."""
    if batch.input_ids.device == device:
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo``, ``lo0``), if it has one:
    a group on one machine keeps gloo's connections on it."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


__all__ = [
    "default_backend",
    "destroy_group",
    "group_device",
    "init_group",
    "loopback_interface",
    "shard_batch",
    "to_device",
]
