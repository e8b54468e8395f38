"""How a learner's step cooperates with the other ranks of its group: a strategy object
given to the one learner (:class:`~rltune.learner.learner.LocalLearner`).

A :class:`Parallelism` wraps the model once, and in every step:

1. ``agree``: every rank says how many rows and micro-batches it has and its shard's loss
   denominator, in **one collective**; each gets back a :class:`StepPlan`: the
   denominator its losses divide by and how many training forwards it runs;
2. ``gradient_sync``: around each micro-batch's forward and backward, whether this
   backward exchanges gradients (only the last does);
3. ``clip_grad_norm``: the norm of the group's gradient (every rank the same);
4. ``all_reduce_metrics`` and ``sum``: the step's metrics and the MoE routing counts of
   the whole group.

``full_state_dict`` gives the unsharded weights (exports and the generators' copy).

Three strategies: :class:`NoParallelism` (``"none"``: one process, no collective),
:class:`DDP` (``"ddp"``: the model replicated on every rank) and :class:`FSDP2`
(``"fsdp2"``: parameters, gradients and optimizer state sharded over the ranks). Why a
group's update equals the one a single process makes on the whole batch:

* **the whole-batch denominator is the group's**: every rltune objective's denominator is
  a count over rows, so the sum of the shards' is the whole batch's;
* **gradients are summed over ranks**: DDP and FSDP2 both *average* gradients over the
  ``W`` ranks, so each rank's losses divide by ``denominator / W``; the average is then
  the sum, which is the single-process gradient;
* **one gradient exchange per step**: the other micro-batches only accumulate locally
  (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``);
* **the clip uses the global norm**: with DDP every rank holds the same summed gradient;
  with FSDP2 ``clip_grad_norm_`` on the sharded (DTensor) gradients all-reduces the norm,
  so every rank takes (or skips) the same step;
* **metrics are the group's**: :func:`rltune.metrics.types.all_reduce`; every rank
  returns the same values.

Tensor, pipeline and expert parallelism are further strategies over a DeviceMesh with
the same methods.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

try:  # FSDP2's public API (torch >= 2.6)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch: DDP only
    fully_shard = None
    DTensor = ()

from rltune.data.records import TrainBatch
from rltune.learner.distributed import group_device, to_device
from rltune.metrics.types import Metric, all_reduce
from rltune.models.load import is_moe

STRATEGIES: tuple[str, ...] = ("none", "ddp", "fsdp2")


@dataclass(frozen=True)
class StepPlan:
    """What the ranks agreed before a step's (or a prediction's) forwards."""

    denominator: torch.Tensor | None
    """What this rank's micro-batch losses divide by (None when none was given: a
    prediction)."""
    forwards: int
    """How many forwards this rank runs: its own micro-batches, then (a strategy whose
    forwards are collectives) forwards on padding rows until it has run as many as the
    group's busiest rank. The last one's backward exchanges gradients."""


class Parallelism(Protocol):
    """Gradient synchronisation and sharding of one learner; every rank calls every
    method together (:class:`NoParallelism` is the strategy of one process)."""

    rank: int
    world: int
    device: torch.device | None
    """Where this rank computes; None: wherever the model is (one process)."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place (and shard) ``model`` in place; returns the module that training
        forwards go through (``model`` itself or a wrapper around it)."""

    def place(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` on this rank's device."""

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        """The plan of the step (or prediction) for which this rank holds ``rows`` rows
        that need ``forwards`` forwards and whose loss denominator is ``denominator``."""

    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> ContextManager[None]:
        """Entered around one micro-batch's forward and backward through ``module`` (what
        :meth:`wrap` returned): whether that backward exchanges gradients."""

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``params`` to the group's norm ``max_norm``; returns that norm."""

    def all_reduce_metrics(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        """The group's metrics from each rank's ``metrics`` (the same names on every rank)."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks that train on different rows."""

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded weights of ``model``, on every rank."""


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over every parameter's gradient at once."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


class NoParallelism:
    """One process trains alone: no collective. ``device`` None: the model and batch stay
    where they are; a device: the model moves there when wrapped, each batch when placed."""

    rank = 0
    world = 1
    device: torch.device | None = None

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model if self.device is None else model.to(self.device)

    def place(self, batch: TrainBatch) -> TrainBatch:
        return batch if self.device is None else to_device(batch, self.device)

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        if rows == 0:
            raise ValueError("the learner received a batch with no rows")
        return StepPlan(denominator, forwards)

    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> ContextManager[None]:
        return contextlib.nullcontext()

    clip_grad_norm = staticmethod(clip_grad_norm)

    def all_reduce_metrics(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        return metrics

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- the group's


def agree_over_ranks(rows: int, forwards: int, denominator: torch.Tensor | None, *,
                     device: torch.device, lockstep: bool, group: Any = None) -> StepPlan:
    """:meth:`Parallelism.agree` of a data-parallel group, in one ``all_gather`` of
    ``(rows, forwards, denominator)``.

    The denominator is the sum of the ranks' over the world size (DDP and FSDP2 average
    the ranks' gradients, so that the average is the sum), in float64 and then in the
    local denominator's dtype; it stays on the device. The counts come to the host, the
    one host sync of the plan: they decide how many forwards run. ``lockstep``: every
    rank runs as many forwards as the busiest rank (FSDP2 gathers parameters in each).
    ``group``: the ranks that train on different rows (None: the whole world)."""
    world = dist.get_world_size(group)
    mine = torch.zeros(3, dtype=torch.float64, device=device)
    mine[0].fill_(rows)  # a fill on the device, not a copy from the host
    mine[1].fill_(forwards)
    if denominator is not None:
        mine[2] = denominator.detach().to(device=device, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every)  # [world, 3]
    rows_per, forwards_per = ([int(v) for v in column] for column in table[:, :2].T.tolist())
    if min(rows_per) == 0:
        raise ValueError(
            f"learner group: rank(s) {[r for r, n in enumerate(rows_per) if n == 0]} received no rows "
            f"(rows per rank: {rows_per}); every rank needs at least one unit of rows: cut the global "
            "batch with shard_batch, which refuses a batch too small for the group"
        )
    if denominator is not None:
        denominator = (table[:, 2].sum() / world).to(device=denominator.device, dtype=denominator.dtype)
    return StepPlan(denominator, max(forwards_per) if lockstep else forwards)


def require_group(strategy: str) -> tuple[int, int]:
    """``(rank, world)`` of this process's group; a clear error without one."""
    if not dist.is_initialized():
        raise RuntimeError(f"parallelism {strategy!r} needs a process group: call init_group() in every "
                           "process first (torchrun or spawn_learner_group starts the processes)")
    return dist.get_rank(), dist.get_world_size()


def sum_over_ranks(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    total = tensor.detach().to(device)
    dist.all_reduce(total)
    return total


# The model's only buffers are constants (rotary frequencies): DDP need not broadcast them
# before every forward (newer torch calls the keyword ``forward_sync_buffers``).
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class _GroupDDP(DistributedDataParallel):
    """DDP that shows the wrapped model's ``config``: the forward helpers read it (MoE
    routing, expert count)."""

    @property
    def config(self) -> Any:
        return self.module.config


class DDP:
    """Every rank holds the whole model (``DistributedDataParallel``) and its shard of the
    batch; the training forward runs through the DDP wrapper."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.rank, self.world = require_group("ddp")
        self.device = device if device is not None else group_device()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return _GroupDDP(
            model.to(self.device),
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            # an MoE micro-batch leaves the experts it did not route to without gradient
            find_unused_parameters=_is_moe(model),
            **_NO_BUFFER_SYNC,
        )

    def place(self, batch: TrainBatch) -> TrainBatch:
        return to_device(batch, self.device)

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        # DDP exchanges gradients in the backward of each rank's own last micro-batch
        # and communicates nowhere else
        return agree_over_ranks(rows, forwards, denominator, device=self.device, lockstep=False)

    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> ContextManager[None]:
        return contextlib.nullcontext() if sync else module.no_sync()

    clip_grad_norm = staticmethod(clip_grad_norm)

    def all_reduce_metrics(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        return all_reduce(metrics)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(tensor, self.device)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}


class FSDP2:
    """Parameters, gradients and optimizer state sharded over the ranks (``fully_shard``:
    each transformer block, then the root); every forward gathers parameters, so every
    rank runs as many forwards as the busiest one."""

    def __init__(self, device: torch.device | None = None) -> None:
        if fully_shard is None:
            raise RuntimeError(f"parallelism 'fsdp2' needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); "
                               f"this is torch {torch.__version__}")
        self.rank, self.world = require_group("fsdp2")
        self.device = device if device is not None else group_device()
        self.offload = "none"
        """``params``: the shards in host memory (``train.offload``, set before :meth:`wrap`)."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from rltune.learner.memory import offload_policy_kwargs

        model.to(self.device)
        _broadcast_weights(model)
        shard_model(model, init_device_mesh(self.device.type, (self.world,)),
                    **offload_policy_kwargs(self.offload, self.device))
        return model

    def place(self, batch: TrainBatch) -> TrainBatch:
        return to_device(batch, self.device)

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        return agree_over_ranks(rows, forwards, denominator, device=self.device, lockstep=True)

    @contextlib.contextmanager
    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> Iterator[None]:
        module.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    clip_grad_norm = staticmethod(clip_grad_norm)

    def all_reduce_metrics(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        return all_reduce(metrics)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(tensor, self.device)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every sharded tensor gathered (a collective)."""
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                for k, v in model.state_dict().items()}


def make_parallelism(strategy: str, device: torch.device | None = None) -> Parallelism:
    """The strategy named ``strategy`` (one of :data:`STRATEGIES`); ``device`` None: the
    group's (``cuda:LOCAL_RANK`` with NCCL, else the CPU). A layout over a DeviceMesh is
    :class:`rltune.parallel.strategy.MeshParallelism`."""
    if strategy == "none":
        return NoParallelism()
    if strategy == "ddp":
        return DDP(device)
    if strategy == "fsdp2":
        return FSDP2(device)
    raise ValueError(f"parallelism strategy={strategy!r}; expected one of {list(STRATEGIES)}")


def shard_model(model: torch.nn.Module, mesh: Any = None, **options: Any) -> None:
    """FSDP2 in place: each transformer block (the classes a Hugging Face model lists in
    ``_no_split_modules``) is one sharded unit, then the root holds the rest (embeddings,
    final norm, head, tied weights together). ``options`` go to every ``fully_shard``
    (``offload_policy``)."""
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of ``model`` whose class a Hugging Face model inside it names in
    ``_no_split_modules``; empty for a model without that attribute."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _is_moe(model: torch.nn.Module) -> bool:
    return hasattr(model, "config") and is_moe(model)


@torch.no_grad()
def _broadcast_weights(model: torch.nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers (FSDP2 shards each rank's own
    copy, so they must agree before sharding)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


__all__ = [
    "DDP",
    "FSDP2",
    "STRATEGIES",
    "NoParallelism",
    "Parallelism",
    "StepPlan",
    "make_parallelism",
    "shard_model",
    "transformer_blocks",
]
