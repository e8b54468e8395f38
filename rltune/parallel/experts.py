"""Expert parallelism: an MoE model's experts split over the ``ep`` ranks of the learner
mesh, each (token, expert) assignment sent to the rank that owns its expert.

:func:`apply_expert_parallel` replaces every experts module (transformers 5 keeps a layer's
experts as one module with 3-D weights ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]``) by :class:`ExpertParallelExperts`, which holds only this rank's contiguous
block of ``E / ep`` experts, as DTensors ``Shard(0)`` over the ep mesh: the full weights
are one ``full_tensor()`` away (exports, checkpoints) and a gradient norm over the group
sees every expert once.

One MoE layer's forward on an ep rank (its own rows; the router and the shared expert
stay whole on every rank):

1. every (token, expert) assignment is sorted by expert, hence by owner rank (rank
   ``expert // (E / ep)``), and the ranks exchange how many assignments each sends to
   each of the other's experts (one small ``all_to_all_single`` of ``[ep, E / ep]``
   counts; the per-rank sums come to the host, since the exchange's split sizes are host
   integers);
2. the assignments' hidden states go to their owners (``all_to_all_single``); each
   arrives sorted by expert within its sender's block, so the counts give every row's
   expert;
3. the owner runs its local experts over what it received (grouped compute, no loop over
   experts);
4. the results come back by the reverse all-to-all, are weighted by the router's
   weights on the sending rank (so the router's gradient never leaves it) and summed
   per token.

Both exchanges are differentiable: the backward of an all-to-all is the all-to-all of
the gradients with the split sizes swapped. Every ep rank must run the same number of
MoE forwards (the exchanges pair up): the learner's step plan runs padding forwards on
a rank with fewer micro-batches (``StepPlan.forwards``, lockstep).

Gradient scale. Each rank's losses divide by ``denominator / data_world`` and the dense
weights' gradients are averaged over the data ranks (fully_shard), which makes them the
whole batch's gradient (``rltune/learner/parallel.py``). An expert's gradient on its
owner already sums the assignments of *every* ep rank (they came through the
all-to-all), so the same average taken over the expert-data ranks only (``data_world /
ep`` of them, or none) leaves it ``ep`` times too large. The learner strategy divides it
(``rltune/parallel/strategy.py``): with expert-data copies, the experts' own fully_shard
unit divides by ``data_world`` instead of its size (``set_gradient_divide_factor``);
without, the experts stay out of the dense units (:func:`expert_parameters`) and their
gradients are divided by ``ep`` before the norm is taken.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

EXPERT_WEIGHTS: tuple[str, ...] = ("gate_up_proj", "down_proj")
"""The parameters of a transformers-5 experts module that expert parallelism shards."""


class ExpertParallelError(ValueError):
    """A model or mesh that expert parallelism cannot split; the message says which."""


# ----------------------------------------------------------------------------- autograd


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 with variable split sizes, differentiable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # what came from rank j goes back to rank j: the splits swap
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows ``x`` sent in consecutive blocks of ``send[j]`` rows to rank ``j`` of
    ``group``; returns the ``sum(recv)`` rows received, rank by rank. Differentiable."""
    return _AllToAll.apply(x, send, recv, group)


# ----------------------------------------------------------------------------- compute


def local_expert_compute(x: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, act) -> torch.Tensor:
    """Each row of ``x`` ``[R, H]`` through the local expert ``expert[r]`` (in ``[0,
    E_local)``), unweighted (the router's weights are applied by the rank that sent the
    row), in the order of ``x``: rows grouped by expert with one stable sort, then two
    grouped matmuls (:func:`rltune.models.experts.experts_by_group`)."""
    from rltune.models.experts import experts_by_group

    if len(x) == 0:
        # nothing received, but the result must still hang on ``x``: the backward of the
        # exchange that brought ``x`` is a collective the other ranks wait in
        return x * 0.0 + 0.0 * (gate_up.sum() + down.sum()).to(x.dtype)
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=gate_up.shape[0])
    out = experts_by_group(x[order], counts, gate_up, down, act)
    return torch.empty_like(out).index_put((order,), out)


# ----------------------------------------------------------------------------- the module


class ExpertParallelExperts(nn.Module):
    """This rank's block of an MoE layer's experts, reached by all-to-all dispatch.

    Called as the experts module it replaces: ``(hidden [N, H], top_k_index [N, k],
    top_k_weights [N, k]) -> [N, H]``, the weighted sum of each token's experts."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        _check_experts(experts)
        total = int(experts.gate_up_proj.shape[0])
        size = ep_mesh.size()
        if total % size:
            raise ExpertParallelError(
                f"{type(experts).__name__}: {total} experts do not split over ep={size} ranks; "
                "set train.parallel.ep to a divisor of the expert count")
        self.num_experts = total
        self.num_local_experts = total // size
        self.first_expert = ep_mesh.get_local_rank() * self.num_local_experts
        self.ep_size = size
        self.group = ep_mesh.get_group()
        self.act_fn = experts.act_fn
        self.config = getattr(experts, "config", None)
        block = slice(self.first_expert, self.first_expert + self.num_local_experts)
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            local = full.detach()[block].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(sharded, requires_grad=full.requires_grad))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # assignment i is token i // k's slot i % k
        order = torch.argsort(flat, stable=True)  # by expert, hence by owner rank
        expert = flat[order]
        local = self.num_local_experts
        # per destination rank, how many assignments go to each of its experts: the
        # receiver learns its split sizes and, rows arriving sorted by expert within each
        # sender's block, every row's expert, without an exchange of expert ids
        send = torch.bincount(expert, minlength=self.num_experts).view(self.ep_size, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()  # host sizes: one sync
        received = all_to_all(hidden[order // k], send_splits, recv_splits, self.group)
        theirs = torch.repeat_interleave(torch.arange(local, device=recv.device).repeat(self.ep_size),
                                         recv.reshape(-1))
        out = local_expert_compute(received, theirs, _local(self.gate_up_proj),
                                   _local(self.down_proj), self.act_fn)
        back = all_to_all(out, recv_splits, send_splits, self.group)  # assignments in `order`
        back = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        # (token, slot) order, then the k slots summed: the one-process compute's order
        pairs = torch.empty_like(back).index_put((order,), back)
        return pairs.view(tokens, k, hidden.shape[-1]).sum(dim=1).to(hidden.dtype)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} "
                f"of {self.num_experts}, ep={self.ep_size}")


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's block of an expert weight (the DTensor's local tensor; differentiable)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _check_experts(experts: nn.Module) -> None:
    """Refuse an experts module whose compute is not the plain gated MLP this module runs."""
    name = type(experts).__name__
    own = {n for n, _ in experts.named_parameters(recurse=False)}
    features = {f: getattr(experts, f, d) for f, d in
                (("has_bias", False), ("is_transposed", False), ("has_gate", True),
                 ("has_post_expert_norm", False))}
    unusual = [f"{f}={v}" for f, v in features.items()
               if v != {"has_bias": False, "is_transposed": False, "has_gate": True,
                        "has_post_expert_norm": False}[f]]
    if own != set(EXPERT_WEIGHTS) or unusual or not hasattr(experts, "act_fn"):
        raise ExpertParallelError(
            f"{name}: expert parallelism splits experts modules holding exactly "
            f"{list(EXPERT_WEIGHTS)} (gated, untransposed, no bias) and an act_fn; this one has "
            f"parameters {sorted(own)}{' and ' + ', '.join(unusual) if unusual else ''}")
    for weight in EXPERT_WEIGHTS:
        if getattr(experts, weight).dim() != 3:
            raise ExpertParallelError(f"{name}.{weight} is not a 3-D [experts, out, in] weight")


# ----------------------------------------------------------------------------- applying


def experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, attribute, experts)`` for every experts module of ``model`` (a module
    with a 3-D ``gate_up_proj``), replaced or not."""
    found = []
    for parent in model.modules():
        for attribute, child in parent.named_children():
            weight = getattr(child, "gate_up_proj", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 3:
                found.append((parent, attribute, child))
    return found


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts of ``model`` over ``ep_mesh`` (1-D, the learner
    mesh's ``ep`` dim), in place: each rank keeps experts ``[r * E/ep, (r+1) * E/ep)``,
    ``r`` its rank on the mesh, and reaches the others by all-to-all.

    ``model`` must already be on the mesh's device type, with the same weights on every
    rank (the strategy loads or broadcasts them before). Raises
    :class:`ExpertParallelError` for a model without experts modules, an expert count
    that ``ep`` does not divide, or an experts module of another kind of compute."""
    if ep_mesh.ndim != 1:
        raise ExpertParallelError(f"apply_expert_parallel needs the 1-D ep mesh, got dims {ep_mesh.mesh_dim_names}")
    found = experts_modules(model)
    if not found:
        raise ExpertParallelError(
            f"train.parallel.ep={ep_mesh.size()} but {type(model).__name__} has no MoE experts "
            "module (3-D gate_up_proj); expert parallelism needs an MoE model: set ep to 1")
    for parent, attribute, experts in found:
        if isinstance(experts, ExpertParallelExperts):
            raise ExpertParallelError(f"{type(model).__name__}: expert parallelism is already applied")
        device = experts.gate_up_proj.device
        if device.type != ep_mesh.device_type:
            raise ExpertParallelError(
                f"the experts are on {device} and the ep mesh on {ep_mesh.device_type}: move the model "
                "to this rank's device before apply_expert_parallel")
        setattr(parent, attribute, ExpertParallelExperts(experts, ep_mesh))


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert-parallel parameters of ``model`` (after :func:`apply_expert_parallel`):
    the weights that the dense data-parallel units must leave out
    (``fully_shard(..., ignored_params=...)``), since each ep rank holds other experts."""
    return {p for _, _, m in experts_modules(model) if isinstance(m, ExpertParallelExperts)
            for p in m.parameters(recurse=False)}


__all__ = [
    "EXPERT_WEIGHTS",
    "ExpertParallelError",
    "ExpertParallelExperts",
    "all_to_all",
    "apply_expert_parallel",
    "expert_parameters",
    "experts_modules",
    "local_expert_compute",
]
