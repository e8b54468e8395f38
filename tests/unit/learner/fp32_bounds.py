"""How far two fp32 computations of the same train step may differ, from the arithmetic.

The micro-batch invariance tests compare a step on the whole batch with the same step on
2 and 4 micro-batches. Both are fp32; they differ in the order of sums and in the shapes
the kernels see, so their roundings differ. These are the bounds the tests use, with the
reasoning; nothing here is tuned to one CPU.

**Gradients.** Every entry of every weight's gradient is a sum over the batch's positions
``t`` of a product of two vectors' entries: ``dW[i, j] = sum_t dy_t[i] * x_t[j]`` for a
linear layer (``x`` its input, ``dy`` the gradient at its output), ``dE[v] = sum_{t: id_t
= v} dh_t`` for the embedding, ``dw = sum_t dy_t * xhat_t`` for an RMS norm, ``db =
sum_t dy_t`` for a bias. With ``u = 2^-24`` (fp32's unit roundoff):

- *The order of the sum* over at most ``N`` positions (``N`` = the whole batch's ``B * T``;
  micro-batches have no more). Recursive summation in any order is within ``(N - 1) u
  sum_t |term_t|`` of the exact sum (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., eq. 4.4); accumulating micro-batch gradients (``p.grad += g``) is
  one more such order.
- *The terms themselves.* ``dy_t`` and ``x_t`` come out of matrix products, norms and
  softmaxes, where an entry is a small difference of large terms: its rounding is relative
  to the largest entry of the vector, not to itself (a gradient entry of 5e-6 next to
  entries of 1e-2 carries errors of 2e-8, 0.5 %). So the magnitude a term is measured by is
  ``|dy_t|_inf * |x_t|_inf``, and ``A = sum_t |dy_t|_inf |x_t|_inf`` (per row for the
  embedding, per tensor elsewhere) is the "sum of |terms|" of the bound. The rounding of
  the factors, relative to ``A``, is at most a few tens of ``u`` on this model (measured
  against a float64 run: at most 31 u on AVX-512, AVX2 and scalar kernels,
  ``ATEN_CPU_CAPABILITY``, with one and two threads), under the ``N u`` of the sum.

So each side is within ``2 N u A`` of the exact gradient (``N u`` for the sum, as much again
for the terms), and the two sides within ``4 N u A`` of each other. With ``N`` ~ 200..400
that is ~1e-4 ``A``, while a real mistake (a micro-batch normalised by its own count, one
counted twice) changes entries by ~|g| >= A / 100: a thousand times more.

**The update.** AdamW's first step moves a parameter by ``lr * g / (|g| + eps)`` (``m = g``,
``v = g^2`` after bias correction), whose slope in ``g`` is at most ``lr / eps``. Clipping
scales ``g`` by ``s = c / |g|_2``; a gradient error ``T`` changes ``s g`` by at most ``s (T +
|g| |T|_2 / |g|_2)``, and each side's rounding of ``|g|_2`` (a sum of ``n`` squares, all >= 0,
so within ``(n - 1) u`` of it, relative, halved by the square root; ``n`` the largest
tensor's size, then the number of tensors) changes ``s`` by up to ``n u / 2``, relative.
The update's own arithmetic is a fixed sequence of ~8 roundings (moments, bias
corrections, square root, eps, division, lr), each relative ``u``, and the parameter is
rounded once (``u |p|``), on each side.
"""

from __future__ import annotations

import dataclasses

import torch

from rltune.data.records import TrainBatch
from rltune.learner.objectives import Objective

U = 2.0 ** -24
"""fp32 unit roundoff: one rounding changes a value by at most this much, relative."""


def gradient_scales(model: torch.nn.Module, objective: Objective, batch: TrainBatch) -> dict[str, torch.Tensor]:
    """``A`` of the module docstring for every parameter of ``model``, from one fp32
    forward and backward of ``objective`` on the whole ``batch`` (``model`` keeps no
    gradient). A parameter outside a linear layer, an embedding or an RMS norm gets
    ``A = 0``, so a test bounding it by ``A`` fails rather than passes unchecked."""
    scales = {id(p): torch.zeros_like(p) for p in model.parameters()}

    def on_forward(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        x = inputs[0].detach()

        def on_backward(dy: torch.Tensor) -> None:
            dy_inf = dy.detach().abs().amax(-1).reshape(-1)  # [positions]
            if isinstance(module, torch.nn.Embedding):
                rows = dy_inf[:, None].expand(-1, module.weight.shape[1]).contiguous()
                scales[id(module.weight)].index_add_(0, x.reshape(-1), rows)
                return
            if isinstance(module, torch.nn.Linear):
                x_inf = x.abs().amax(-1).reshape(-1)
                if module.bias is not None:
                    scales[id(module.bias)] += dy_inf.sum()
            else:  # RMS norm: the weight multiplies the normalised input
                xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
                x_inf = xhat.abs().amax(-1).reshape(-1)
            scales[id(module.weight)] += (dy_inf * x_inf).sum()

        out.register_hook(on_backward)

    hooks = [m.register_forward_hook(on_forward) for m in model.modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or hasattr(m, "variance_epsilon")]
    try:
        out = objective.forward(model, batch, temperature=1.0, router_logits=False)
        loss, _ = objective.loss(out, batch, objective.denominator(batch))
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return {name: scales[id(p)] for name, p in model.named_parameters()}


def gradient_tolerance(scales: dict[str, torch.Tensor], batch: TrainBatch) -> dict[str, torch.Tensor]:
    """How far two fp32 computations of the whole batch's gradient may differ, per entry:
    ``4 N u A`` (module docstring)."""
    positions = batch.input_ids.numel()
    return {name: 4 * positions * U * a for name, a in scales.items()}


def clipped_tolerance(
    grads: dict[str, torch.Tensor], grad_tol: dict[str, torch.Tensor], *, clip: float | None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """``(s, T)``: the clip's scale ``s`` of the (unclipped) gradients ``grads``, and how
    far the clipped gradients may differ, per entry, when ``grads`` may differ by
    ``grad_tol`` (module docstring)."""
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    tol_norm = torch.sqrt(sum((t.double() ** 2).sum() for t in grad_tol.values()))
    scale = 1.0 if clip is None else min(1.0, clip / float(norm))
    norm_rounding = 0.0 if scale == 1.0 else (max(g.numel() for g in grads.values()) + len(grads)) * U
    return scale, {name: scale * (grad_tol[name] + g.abs() * (float(tol_norm / norm) + norm_rounding))
                   for name, g in grads.items()}


def update_tolerance(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], grad_tol: dict[str, torch.Tensor],
    *, lr: float, eps: float, clip: float | None,
) -> dict[str, torch.Tensor]:
    """How far the parameters after AdamW's first step may differ, per entry, when the
    (unclipped) gradients ``grads`` may differ by ``grad_tol`` (module docstring)."""
    _, g_tol = clipped_tolerance(grads, grad_tol, clip=clip)
    return {name: lr / eps * g_tol[name] + 2 * U * (p.abs() + 8 * lr) for name, p in params.items()}


def small_eps_update_tolerance(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], grad_tol: dict[str, torch.Tensor],
    *, lr: float, eps: float, clip: float | None,
) -> dict[str, torch.Tensor]:
    """:func:`update_tolerance` by the update's slope where the gradient is, not its
    largest slope: what makes a bound for Adam's default eps (1e-8).

    There the largest slope ``lr / eps`` (1e5 at lr 1e-3) would allow more than the
    ``2 lr`` by which any two first steps can differ. But the first step
    ``lr g / (|g| + eps)`` has slope ``lr eps / (|g| + eps)^2``, which falls fast once
    ``|g| >> eps``: when the clipped gradient ``c = s g`` may be off by ``T``, every value
    between lies at least ``max(|c| - T, 0)`` from 0, so the updates differ by at most
    ``T lr eps / (max(|c| - T, 0) + eps)^2`` (mean value theorem), and never by more than
    ``2 lr``; the update's own roundings and the parameter's as in :func:`update_tolerance`."""
    scale, g_tol = clipped_tolerance(grads, grad_tol, clip=clip)
    out = {}
    for name, p in params.items():
        nearest = (scale * grads[name].double().abs() - g_tol[name]).clamp(min=0.0)
        slope_bound = (g_tol[name] * lr * eps / (nearest + eps) ** 2).clamp(max=2 * lr)
        out[name] = slope_bound + 2 * U * (p.double().abs() + 8 * lr)
    return out


def worst_excess(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                 tol: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``|got - expected| / tol`` over all entries (inf where the tolerance is
    0 and the values differ), and the parameter it is in."""
    worst, where = 0.0, ""
    for name, value in got.items():
        diff = (value.double() - expected[name].double()).abs()
        ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / tol[name].double())
        if float(ratio.max()) > worst:
            worst, where = float(ratio.max()), name
    return worst, where


def assert_within(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  tol: dict[str, torch.Tensor], what: str) -> None:
    worst, where = worst_excess(got, expected, tol)
    assert worst <= 1.0, f"{what} of {where} differ by {worst:.3g} times the derived tolerance"


# ------------------------------------------------------------ shared by the invariance tests


def capture_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A dict that fills with each parameter's accumulated gradient as the backward passes
    finish (before any clipping): the last call of the hook sees the whole sum."""
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.update({name: p.grad.clone()}))
    return grads


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def first_twice(right: Objective) -> Objective:
    """A mistake for the controls: the first micro-batch counted twice."""
    calls = []

    def loss(out, mb, denominator):
        calls.append(mb)
        total, metrics = right.loss(out, mb, denominator)
        return (2 if len(calls) == 1 else 1) * total, metrics

    return dataclasses.replace(right, loss=loss)

