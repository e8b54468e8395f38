"""The :class:`~rltune.learner.parallel.Parallelism` of a learner group laid out as one
DeviceMesh (``rltune/parallel/layout.py``, ``rltune/parallel/mesh.py``).

:meth:`MeshParallelism.wrap` applies, in this order: the pipeline split (pp > 1), tensor
parallelism (tp > 1), expert parallelism (ep > 1), then data-parallel ``fully_shard`` of
each transformer block and the root (when the group has more than one data rank). The
other parallel modules are imported inside ``wrap``, so a layout that does not use one
never needs it.

Why the group's update is one process's on the whole batch (as for
:mod:`rltune.learner.parallel`'s DDP and FSDP2):

* the step plan is agreed among the **data ranks** only: tp and pp peers hold the same
  rows, so counting them would count those rows twice; each data rank's losses divide by
  ``denominator / data_world`` because FSDP2 averages gradients over the data mesh;
* **expert gradients** are summed over the ``ep`` ranks already (the all-to-all's
  backward brings every ep rank's tokens to the rank holding the expert), and then
  averaged only over ``dp_replicate x dp_shard``; so they are ``ep`` times too large and
  are divided by ``ep`` (FSDP2's gradient divide factor, or by hand when the experts have
  no data-parallel copies);
* the **gradient norm** is the square root of the sum of squares of every rank's local
  shards, each shard counted once: a DTensor's norm is reduced over its own mesh, and
  with pp > 1 the stages' squares are summed over ``pp``; every rank gets the same norm
  and takes (or skips) the same step;
* **metrics** are combined over the data ranks. With pp > 1 only the last stage computes
  the loss and its metrics: the pipeline's step must hand them to every stage (broadcast
  over ``pp``) before :meth:`MeshParallelism.all_reduce_metrics`, so that every rank of
  the world returns the same values.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rltune.data.records import TrainBatch
from rltune.learner.distributed import group_device, to_device
from rltune.learner.parallel import StepPlan, _broadcast_weights, agree_over_ranks, transformer_blocks
from rltune.metrics.types import Metric, all_reduce
from rltune.parallel.layout import Layout
from rltune.parallel.mesh import build_mesh, data_group, data_rank, data_world, dense_dp_mesh, expert_dp_mesh


class MeshParallelism:
    """A learner group of ``layout`` over ``mesh`` (None: built here, which every rank
    must do together); ``device`` None: the group's (``cuda:LOCAL_RANK`` with NCCL, else
    the CPU). ``rank`` and ``world`` are the DATA rank and world: the shard of each
    global batch this rank trains on, and how many shards there are."""

    def __init__(self, layout: Layout, mesh: DeviceMesh | None = None, device: torch.device | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("MeshParallelism needs a process group: call init_group() in every process first "
                               "(torchrun or spawn_learner_group starts the processes)")
        self.layout = layout
        self.device = device if device is not None else group_device()
        self.mesh = mesh if mesh is not None else build_mesh(layout, self.device.type)
        self.rank, self.world = data_rank(self.mesh), data_world(self.mesh)
        self.group = data_group(self.mesh)
        self.pipeline: Any = None
        """The pipeline (pp > 1): what ``rltune.parallel.pipeline.apply_pipeline`` returns;
        None with pp == 1."""
        self.sharded = False
        self._experts_by_hand: list[torch.nn.Parameter] = []
        self.offload = "none"
        """``params``: FSDP2's shards in host memory (``train.offload``, set before :meth:`wrap`)."""

    # -- wrapping ----------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Split, shard and place ``model`` in place (the module docstring's order);
        returns the module training forwards go through."""
        model.to(self.device)
        _broadcast_weights(model)  # every rank starts from rank 0's weights, before any split
        layout = self.layout
        if layout.pp > 1:
            from rltune.parallel.pipeline import apply_pipeline

            self.pipeline = apply_pipeline(model, self.mesh, layout)
            # the stage is what runs forwards: it is the FSDP root (embeddings, final
            # norm, head gathered by its hooks) and the schedule drives its reduction
            root = self.pipeline.stage
        if layout.tp > 1:
            from rltune.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(model, self.mesh["tp"], sequence_parallel=layout.sequence_parallel)
        if layout.ep > 1:
            from rltune.parallel.experts import apply_expert_parallel

            apply_expert_parallel(model, self.mesh["ep"])
        self._data_parallel(root if layout.pp > 1 else model)
        return root if layout.pp > 1 else model

    def _data_parallel(self, model: torch.nn.Module) -> None:
        """``fully_shard`` over the data mesh: the experts over their own mesh first (with
        the ``ep`` divide factor), then each block and the root over the dense mesh."""
        dense = dense_dp_mesh(self.mesh)
        options = self._offload_options(dense)
        if dense is None:
            return
        experts = expert_modules(model) if self.layout.ep > 1 else []
        ignored: set[torch.nn.Parameter] = set()
        expert_mesh = expert_dp_mesh(self.mesh)
        for module in experts:
            if expert_mesh is None:  # no data-parallel copies: divided in clip_grad_norm
                ignored.update(module.parameters())
                continue
            fully_shard(module, mesh=expert_mesh)
            # FSDP2 divides by its mesh's size; the ep ranks' sum needs ep more
            module.set_gradient_divide_factor(float(expert_mesh.size() * self.layout.ep))
            # a factor other than the mesh size is a PREMUL_SUM reduction, which gloo lacks:
            # sum, then divide. Not with one shard rank (dp_shard = 1): FSDP2 then skips the
            # reduce-scatter and divides by the factor before the replicas' all-reduce, and
            # a forced sum would divide by it a second time after
            module.set_force_sum_reduction_for_comms(self.layout.dp_shard > 1)
        self._experts_by_hand = list(ignored)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=dense, ignored_params=ignored or None, **options)
        fully_shard(model, mesh=dense, ignored_params=ignored or None, **options)
        self.sharded = True

    def _offload_options(self, dense: DeviceMesh | None) -> dict[str, Any]:
        """``fully_shard``'s offload options; ``offload: params`` is taken by a layout of
        data-parallel sharding alone (tested there), refused otherwise."""
        if self.offload != "params":
            return {}
        other = {k: getattr(self.layout, k) for k in ("tp", "pp", "ep") if getattr(self.layout, k) > 1}
        if dense is None or other:
            why = f"with {other}" if other else "without data-parallel ranks (nothing is sharded)"
            raise ValueError(
                f"train.offload: params (FSDP2's CPU offload) is supported on data-parallel layouts "
                f"(train.parallel dp_shard > 1, tp = pp = ep = 1); this layout is {self.layout} {why}"
            )
        from rltune.learner.memory import offload_policy_kwargs

        return offload_policy_kwargs(self.offload, self.device)

    def place(self, batch: TrainBatch) -> TrainBatch:
        return to_device(batch, self.device)

    # -- the step ----------------------------------------------------------------------

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        # over the data ranks only; tp and pp peers have the same rows, hence the same plan
        return agree_over_ranks(rows, forwards, denominator, device=self.device, lockstep=True, group=self.group)

    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> ContextManager[None]:
        if not self.sharded:
            return contextlib.nullcontext()
        return _fsdp_sync(module, sync)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip to the group's total norm (every rank the same); returns that norm."""
        if self._experts_by_hand:
            with torch.no_grad():
                for p in self._experts_by_hand:
                    if p.grad is not None:
                        _local(p.grad).div_(self.layout.ep)
        grads = [p.grad for p in params if p.grad is not None]
        # a tied embedding's copy on the last stage is counted once (the first stage's)
        tied = self.pipeline.tied_copy if self.pipeline is not None else None
        counted = [p.grad for p in params if p.grad is not None and p is not tied]
        total = grad_norm(counted, pp_group=self.mesh["pp"].get_group() if self.layout.pp > 1 else None,
                          device=self.device)
        coef = max_norm / (float(total) + 1e-6)
        if math.isfinite(coef) and coef < 1.0:
            with torch.no_grad():
                torch._foreach_mul_([_local(g) for g in grads], coef)
        return total

    def all_reduce_metrics(self, metrics: dict[str, Metric]) -> dict[str, Metric]:
        return all_reduce(metrics, group=self.group)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.detach().to(self.device)
        dist.all_reduce(total, group=self.group)
        return total

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every tensor of ``model`` unsharded, on every rank (a collective of the whole
        group). With pp > 1 the pipeline gathers the other stages' tensors too."""
        local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                 for k, v in model.state_dict().items()}
        if self.pipeline is not None:
            return self.pipeline.full_state_dict(local)
        return local


@contextlib.contextmanager
def _fsdp_sync(module: torch.nn.Module, sync: bool) -> Iterator[None]:
    module.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (itself for a plain tensor)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def grad_norm(grads: list[torch.Tensor], *, pp_group: Any = None, device: torch.device | None = None) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together, each element counted once, whatever the
    meshes their DTensors live on: each (mesh, placements) group's norm is reduced over
    its mesh (``full_tensor``), plain tensors are whole on every rank, and the stages'
    squares are summed over ``pp_group`` (None: one stage). Float32, on ``device`` (a
    stage without gradients still takes part in the sum); every rank the same value."""
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    squares = []
    for tensors in groups.values():
        norm = torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding routed experts' weights: those with a 3-D parameter of their
    own (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` in transformers 5)."""
    return [m for m in model.modules()
            if any(p.dim() == 3 for p in m.parameters(recurse=False))]


__all__ = ["MeshParallelism", "expert_modules", "grad_norm"]
