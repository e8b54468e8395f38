"""Log-probs and entropy from vocabulary-sharded logits, never gathering ``[B, T, V]``.

A tensor-parallel ``lm_head`` (:func:`rltune.parallel.tensor.apply_tensor_parallel`)
returns its logits as a DTensor sharded on the vocabulary; :func:`vocab_shard` finds that
layout and :func:`vocab_parallel_token_stats` computes the whole vocabulary's
log-softmax at the targets and the entropy from each rank's slice, with all-reduces of
``[B, T]`` tensors only. It lives with the models because
:func:`rltune.models.logprobs.completion_logprobs` reads any logits through it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


class VocabParallelError(ValueError):
    """Logits sharded in a way the log-probs cannot read."""


class _SumOverGroup(torch.autograd.Function):
    """``all_reduce(x, SUM)`` whose backward passes the gradient through unchanged.

    Every tp rank computes the same loss from the summed value, so the gradient of its
    own partial term is the incoming gradient itself (Megatron's "reduce from the
    tensor-parallel region"). ``torch.distributed.nn.functional.all_reduce`` would
    all-reduce the gradient too, counting the one loss ``tp`` times."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def vocab_shard(logits: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup, int] | None:
    """``(local, group, start)`` when ``logits`` is a DTensor sharded on its last dim
    (what a tensor-parallel ``lm_head`` returns): this rank's ``[..., V/tp]`` slice (still
    in the autograd graph), the group that holds the others and the first vocabulary id
    of the slice; None for ordinary logits. Any other DTensor layout is an error: the
    log-probs need either the whole vocabulary or one even split of it."""
    if not isinstance(logits, DTensor):
        return None
    vocab_dims = [i for i, p in enumerate(logits.placements)
                  if isinstance(p, Shard) and p.dim in (-1, logits.ndim - 1)]
    others = [p for i, p in enumerate(logits.placements) if i not in vocab_dims and not isinstance(p, Replicate)]
    if len(vocab_dims) != 1 or others:
        raise VocabParallelError(
            f"logits of global shape {tuple(logits.shape)} arrived as a DTensor with placements "
            f"{logits.placements}; the log-probs read logits sharded on the vocabulary over one mesh dim "
            f"(Shard(-1), as apply_tensor_parallel's lm_head returns), replicated elsewhere")
    mesh_dim = vocab_dims[0]
    local = logits.to_local()
    vocab, size = logits.shape[-1], logits.device_mesh.size(mesh_dim)
    if vocab % size:
        raise VocabParallelError(f"vocabulary of {vocab} split unevenly over {size} ranks")
    start = logits.device_mesh.get_local_rank(mesh_dim) * (vocab // size)
    return local, logits.device_mesh.get_group(mesh_dim), start


def vocab_parallel_token_stats(
    local: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, start: int,
    *, with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p(target), entropy)`` over the whole vocabulary from this rank's slice
    ``local`` ``[..., V/tp]`` of the logits (vocabulary ids ``start .. start + V/tp - 1``),
    without gathering them; ``targets`` ``[...]`` long (global ids). Both differentiable.

    ``log p(t) = z_t - m - log S`` with ``m`` the all-reduced max (no gradient: it cancels)
    and ``S = sum_v exp(z_v - m)`` all-reduced; ``z_t`` comes from the rank that holds
    ``t`` (the others add 0). Entropy ``log S - A / S`` with ``A = sum_v exp(z_v - m)
    (z_v - m)`` all-reduced. Three all-reduces of ``[...]`` (four with entropy), each
    ``1/V`` of the logits. Compute in float32: the caller upcasts."""
    with torch.no_grad():
        peak = local.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = local - peak.unsqueeze(-1)
    exp = shifted.exp()
    total = _SumOverGroup.apply(exp.sum(dim=-1), group)
    width = local.shape[-1]
    inside = (targets >= start) & (targets < start + width)
    index = (targets - start).clamp(0, width - 1).unsqueeze(-1)
    mine = torch.where(inside, shifted.gather(-1, index).squeeze(-1), shifted.new_zeros(()))
    picked = _SumOverGroup.apply(mine, group)
    log_total = total.log()
    entropy = None
    if with_entropy:
        weighted = _SumOverGroup.apply((exp * shifted).sum(dim=-1), group)
        entropy = log_total - weighted / total
    return picked - log_total, entropy



__all__ = ["VocabParallelError", "vocab_parallel_token_stats", "vocab_shard"]
