"""Mixture-of-experts compute without a Python loop over experts.

A transformers-5 experts module holds every expert in two 3-D weights, ``gate_up_proj
[E, 2I, H]`` and ``down_proj [E, H, I]``. Its ``eager`` forward loops over the experts in
Python, one small matmul pair per expert, and its backward is worse: each expert's weight
slice ``gate_up_proj[e]`` sends back a full ``[E, 2I, H]`` zero gradient with one slice
filled, so the backward's zero-fills and additions grow with the square of the expert
count. Here the ``N * k`` (token, slot) pairs are sorted by expert once, so every expert's
rows are one contiguous block, and each projection is ONE grouped matmul
(``torch.nn.functional.grouped_mm``, offsets at the block ends; its backward is grouped
too) whatever the number of experts. Each row meets the same expert weights as in the
loop, so outputs and gradients agree with ``eager`` to rounding. The rows go back into
their tokens with ``index_add_``: on CUDA that accumulates with atomics (bitwise
run-to-run equality then needs ``torch.use_deterministic_algorithms``).

:func:`grouped_experts` is the pure function (expert parallelism calls it on the experts a
rank holds); :func:`experts_by_group` is its core for rows already grouped by expert.
:func:`use_grouped_experts` switches a loaded model over, through transformers' experts
interface (so ``model.config._experts_implementation`` names :data:`IMPLEMENTATION`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

logger = logging.getLogger(__name__)

IMPLEMENTATION = "rltune_grouped"
"""The name under which :func:`grouped_experts` is registered with transformers."""
REPLACED = ("eager", "grouped_mm")
"""Implementations :func:`use_grouped_experts` replaces: transformers' per-expert loop and
its own grouped matmul (same kernel as ours; replaced so that every MoE model rltune runs,
on one process or split by expert, computes experts through the same function)."""


# The public name from torch 2.10 on; the private one before.
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


class ExpertsLayoutError(ValueError):
    """Expert weights or routing tensors do not have the shapes the grouped compute needs."""


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows [S, in] @ weight[e].T`` for the block of rows of each expert ``e``.

    ``weight`` is ``[E, out, in]`` (transformers' layout); the transpose is a view, as the
    kernel reads either stride order."""
    return _GROUPED_MM(rows.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)


def experts_by_group(
    rows: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The gated expert MLP of each row, for rows already grouped by expert.

    ``rows [S, H]`` holds ``counts[0]`` rows for expert 0, then ``counts[1]`` for expert
    1, and so on (``counts [E]`` integers summing to ``S``), which is how tokens arrive
    after an expert-parallel all-to-all. Returns ``down[e] @ (act(g) * u)`` with ``g, u``
    the halves of ``gate_up[e] @ row``, shape ``[S, H]``: two grouped matmuls in all.
    """
    _check_weights(gate_up, down, rows.shape[-1], where="experts_by_group")
    if counts.shape != (gate_up.shape[0],) or int(counts.sum()) != rows.shape[0]:
        # Rows past the last offset would come back as uninitialised memory: refuse.
        raise ExpertsLayoutError(
            f"experts_by_group: counts (shape {tuple(counts.shape)}, sum {int(counts.sum())}) "
            f"must hold one count per expert ({gate_up.shape[0]}) summing to the "
            f"{rows.shape[0]} rows"
        )
    if rows.shape[0] == 0:
        # No rows (a rank whose experts drew no token): skip the kernel but keep both
        # weights in the graph, so they get zero gradients rather than none, as on the
        # ranks whose experts did get tokens (gradient reductions expect every rank's).
        return rows.new_zeros(0, rows.shape[-1]) + 0.0 * (gate_up.sum() + down.sum())
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = _grouped_mm(rows, gate_up, offsets)
    gate, up = hidden.chunk(2, dim=-1)
    return _grouped_mm(act(gate) * up, down, offsets)


def grouped_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' weighted output for each token, ``[N, H]``.

    ``hidden [N, H]``; ``top_k_index [N, k]`` the experts each token goes to (in ``[0,
    E)``) and ``top_k_weights [N, k]`` their routing weights; ``gate_up [E, 2I, H]`` and
    ``down [E, H, I]`` the experts' weights; ``act`` the activation of the gate half. The
    (token, slot) pairs are sorted by expert (a stable sort, so within an expert tokens
    keep their order, as in the loop), run through :func:`experts_by_group`, weighted and
    added into their tokens. Differentiable in ``hidden``, ``top_k_weights`` and both
    weights.
    """
    n, width = hidden.shape if hidden.dim() == 2 else (None, None)
    if n is None or top_k_index.dim() != 2 or top_k_index.shape[0] != n \
            or top_k_weights.shape != top_k_index.shape:
        raise ExpertsLayoutError(
            f"grouped_experts: expected hidden [N, H], top_k_index and top_k_weights [N, k]; got "
            f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    experts, k = gate_up.shape[0], top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    low, high = torch.stack(torch.aminmax(flat)).tolist() if flat.numel() else (0, 0)
    if low < 0 or high >= experts:
        raise ExpertsLayoutError(
            f"grouped_experts: top_k_index holds expert ids in [{low}, {high}] but the "
            f"weights hold {experts} experts (ids 0..{experts - 1})"
        )
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=experts)
    out = experts_by_group(hidden.index_select(0, token), counts, gate_up, down, act)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    # Each token's k rows added into it in expert order, as the loop does; the backward is
    # a gather of the token's gradient.
    return hidden.new_zeros(n, width).index_add_(0, token, out.to(hidden.dtype))


def _check_weights(gate_up: torch.Tensor, down: torch.Tensor, width: int, *, where: str) -> None:
    """Raise unless ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` fit each other and H."""
    ok = (
        gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[2] == width and down.shape[1] == width
        and gate_up.shape[1] == 2 * down.shape[2]
    )
    if not ok:
        raise ExpertsLayoutError(
            f"{where}: expert weights gate_up {tuple(gate_up.shape)} and down "
            f"{tuple(down.shape)} do not fit [E, 2I, H] and [E, H, I] with H={width}"
        )


def supports_grouped(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module :func:`grouped_experts` computes
    exactly: concatenated gate and up halves, ``[E, out, in]`` weights, no biases, no norm
    after the experts, the default ``act(gate) * up`` gating."""
    return (
        getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True) and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_post_expert_norm", True)
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and getattr(type(module), "_apply_gate", None) is _default_apply_gate
    )


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward under :data:`IMPLEMENTATION` (transformers calls it
    with the module as ``self``)."""
    if not supports_grouped(self) or getattr(self, "_is_expert_parallel", False):
        raise ExpertsLayoutError(
            f"{type(self).__name__} has an experts layout rltune's grouped compute does not "
            f"handle (biases, transposed or interleaved weights, a custom gate or transformers' "
            f"own expert parallelism); select another experts implementation for this model"
        )
    return grouped_experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn
    )


ExpertsInterface.register(IMPLEMENTATION, grouped_experts_forward)


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules that dispatch through transformers' experts interface."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "_is_expert_parallel")]


def use_grouped_experts(model: nn.Module) -> str | None:
    """Switch a mixture-of-experts ``model`` from transformers' expert compute to
    :data:`IMPLEMENTATION`.

    Replaces the implementations in :data:`REPLACED` and logs one INFO line naming the old
    and the new one; returns the implementation the model ends with (None, with a warning,
    for a model without interface-dispatched experts modules). A model whose experts layout the grouped
    compute does not handle keeps transformers' ``grouped_mm`` (also loop-free), with a
    warning; its ``eager`` loop is never kept.
    """
    modules = experts_modules(model)
    if not modules:
        logger.warning(
            "%s has no experts module dispatched through transformers' experts interface: its "
            "experts run the model's own code, which may loop over experts", type(model).__name__,
        )
        return None
    old = model.config._experts_implementation
    if old not in REPLACED:
        return old
    new = IMPLEMENTATION if all(supports_grouped(m) for m in modules) else "grouped_mm"
    if new != old:
        model.set_experts_implementation(new)
    stayed = sorted({m.config._experts_implementation for m in modules} - {new})
    if stayed:
        raise ExpertsLayoutError(
            f"{type(model).__name__} did not accept experts implementation {new!r}: some of "
            f"its experts modules stayed on {stayed}, which may loop over experts in Python"
        )
    if new == IMPLEMENTATION:
        logger.info("experts implementation of %s: %s replaced by %s", type(model).__name__, old, new)
    else:
        logger.warning(
            "experts implementation of %s: %s, then transformers' grouped_mm: its experts layout "
            "is not one rltune's grouped compute handles", type(model).__name__, old,
        )
    return new
