"""The generator's forward, kept for the learner: a training forward without its products.

In a synchronous run whose generator decodes on the learner's own module (the local
runtime, ``rollout.engine: hf``, :class:`~rltune.rollout.fastpath.LeanDecoder`, eager or
with ``rollout.compile``), the decode has already run every token the learner's forward
will run, with the same weights: the prompt once per group, then each fed completion
token. A training forward over those tokens repeats the decode's matrix products. With
a record kept, the learner's lean forward (:mod:`rltune.models.lean_forward`) takes
each projection's output from the record instead of computing it (:class:`Replayed`);
everything between the products (norms, rotary, attention, SiLU) runs again, so
autograd has the graph it needs, and the backward is the usual one: for
``y = x Wᵀ + b`` it needs ``x`` and ``W``, never ``y``'s product.

Per decoder layer the record holds four outputs of every token: the q/k/v projections
side by side (before rotary), the hidden state after the attention's residual addition,
the gate and up projections side by side, and the hidden state after the MLP's. The
residual sums are kept rather than the o and down products because on packed weights
the decode adds the residual in the product's kernel (one rounding, which the replay
then reproduces exactly).

What is exact and what is not: the replayed forward computes the same function of the
same weights, so its log-probs and gradients are those of the training forward up to
the float32 summation order of the decode's kernels (the decode's row-by-row products
against the learner's batched GEMM; measured ~1e-6 relative). In exchange the
learner's log-probs equal the sampler's, so ``logprob_mismatch`` is ~0 on replayed rows
(the head's rounding).

When a record is used: only while the weights are those it was made with. The learner
drops its model's records after each step (:func:`forget`), as do a checkpoint loaded
into it, a weight load into the generator, and a step of any other ``torch.optim``
optimizer over the model's parameters (a global step hook; a critic's optimizer leaves
the policy's records); a later forward then runs in full. A micro-batch is replayed
only when each of its rows is a recorded row, matched by its tokens (prompt and fed
completion, the prompt's left padding alike), in float32 without autocast and without
activation checkpointing; otherwise it runs in full. Memory: the records of one step's
generations are kept until the step's optimizer step, up to the budget ``keep_records``
was given (``train.reuse_rollout_mb``), the oldest dropped first to make room; a
generation whose record alone would pass it (sized for ``max_new_tokens``) keeps none
and drops nothing. A held-out evaluation's generations on the module are kept too (no
training forward reads them; a generation that needs their room evicts them first, and
the learner's next step drops them).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from rltune.metrics import keys
from rltune.metrics.types import Mean, Metric

_STORE = "_rltune_forward_records"
"""The attribute of a model that holds its :class:`RecordStore` (set by :func:`keep_records`)."""

_HOOKED: list[object] = []


@dataclass
class LayerRecord:
    """One layer's kept outputs: the prompts' ``[U, P, W]`` and the fed tokens' ``[R, S, W]``."""

    prompt: list[torch.Tensor]
    steps: list[torch.Tensor]


@dataclass(eq=False)
class Record:
    """One generation's forward: ``prompt_ids`` / ``prompt_mask`` ``[U, P]`` (the prefill's
    left-padded prompts), each run for ``repeats`` adjacent rows; ``tokens [R, S]`` the
    completion tokens fed after the prefill (``fed`` of them so far); per layer the
    outputs (:class:`LayerRecord`: qkv, after attention, gate/up, after MLP)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    repeats: int
    tokens: torch.Tensor
    layers: list[LayerRecord]
    fed: int = 0
    ready: bool = False
    """Set once the prefill has filled the prompt outputs: a record is matched only then."""

    def put_prompt(self, layer: int, outputs: tuple[torch.Tensor, ...]) -> None:
        for kept, value in zip(self.layers[layer].prompt, outputs):
            kept.copy_(value)

    def put_step(self, layer: int, outputs: tuple[torch.Tensor, ...]) -> None:
        """The outputs ``[R, W]`` (or ``[R, 1, W]``) of fed token ``self.fed``."""
        for kept, value in zip(self.layers[layer].steps, outputs):
            kept[:, self.fed].copy_(value.reshape(kept.shape[0], -1))


@dataclass(eq=False)
class RecordStore:
    """A model's kept records (the current weights' only) and the budget they may use."""

    budget_bytes: int
    owner: Callable[[], nn.Module | None]
    """A weak reference to the model whose records these are."""
    records: list[Record] = field(default_factory=list)
    replayed_rows: int = 0
    full_rows: int = 0

    def used_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self.records for layer in r.layers
                   for t in (*layer.prompt, *layer.steps))

    def __reduce__(self) -> tuple:
        """A copy (``copy.deepcopy`` of the model, pickling) is an empty store of the same
        budget owned by no model: the records are the original's weights', and an
        ownerless store's records are dropped at any optimizer step."""
        return RecordStore, (self.budget_bytes, _no_owner)

    def take_counts(self) -> tuple[int, int]:
        """``(replayed, full)`` training rows since the last call."""
        counts = (self.replayed_rows, self.full_rows)
        self.replayed_rows = self.full_rows = 0
        return counts


def keep_records(model: nn.Module, budget_bytes: int) -> None:
    """Let decodes on ``model`` keep their forward for its training forward, up to
    ``budget_bytes`` at a time (0: keep none, and forget any kept)."""
    if budget_bytes <= 0:
        model.__dict__.pop(_STORE, None)
        return
    model.__dict__[_STORE] = RecordStore(budget_bytes, weakref.ref(model))
    if not _HOOKED:  # an optimizer step changes its parameters in place: their records are stale
        _HOOKED.append(register_optimizer_step_post_hook(_forget_stepped))


def _no_owner() -> None:
    return None


_STORES: weakref.WeakSet[RecordStore] = weakref.WeakSet()
"""Every store that holds records, for the optimizer hook."""


def _forget_stepped(optimizer: torch.optim.Optimizer, *_: object) -> None:
    """After ``optimizer``'s step: drop the records of every model it has a parameter of
    (another model's, a critic's say, stay). An optimizer that steps copies of the
    parameters (host offload) is not seen here; the learner drops its model's records
    after each step itself (:func:`forget`)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for store in list(_STORES):
        owner = store.owner()
        if owner is None or any(id(p) in stepped for p in owner.parameters()):
            store.records.clear()
            _STORES.discard(store)


def store_of(model: nn.Module) -> RecordStore | None:
    """``model``'s store (the unwrapped module's under DDP), None unless :func:`keep_records`."""
    inner = getattr(model, "module", model)
    return inner.__dict__.get(_STORE)


def forget(model: nn.Module) -> None:
    """Drop ``model``'s records (its weights were changed)."""
    store = store_of(model)
    if store is not None:
        store.records.clear()


def start_record(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, repeats: int, steps: int,
                 widths: tuple[int, ...], layers: int) -> Record | None:
    """A new record for a generation of ``ids [U, P]`` (``repeats`` rows each, up to
    ``steps`` fed tokens) on ``model``, each layer's outputs ``widths`` wide; None when
    the model keeps none, or the record would pass its store's budget."""
    store = store_of(model)
    if store is None:
        return None
    units, width = ids.shape
    rows = units * repeats
    need = (units * width + rows * steps) * sum(widths) * layers * 4
    if need > store.budget_bytes:
        return None  # sized for max_new_tokens: the older records stay
    while store.records and store.used_bytes() + need > store.budget_bytes:
        store.records.pop(0)  # the oldest first: a step learns on its latest generations
    # made outside inference mode: the learner's autograd graph takes them as inputs
    with torch.inference_mode(False):
        def kept(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.float32, device=ids.device)
        record = Record(
            prompt_ids=ids.clone(), prompt_mask=mask.clone(), repeats=repeats,
            tokens=torch.zeros(rows, steps, dtype=torch.long, device=ids.device),
            layers=[LayerRecord([kept(units, width, w) for w in widths], [kept(rows, steps, w) for w in widths])
                    for _ in range(layers)],
        )
    store.records.append(record)
    _STORES.add(store)
    return record


@dataclass
class Match:
    """Where a micro-batch's rows are in a record: row ``b`` is recorded row ``rows[b]``."""

    record: Record
    rows: torch.Tensor


def find(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
         usable: bool = True) -> Match | None:
    """The record holding every row of ``input_ids [B, P + C]`` (prompt ``P`` left-padded,
    completion right-padded), None when none does or the caller cannot use one
    (``usable``); counts the rows of a training forward (grad enabled) as replayed or not."""
    store = store_of(model)
    if store is None:
        return None
    match = None
    if usable and not torch.is_autocast_enabled(input_ids.device.type):
        match = next((m for r in reversed(store.records)
                      if (m := _match(r, input_ids, attention_mask, prompt_len)) is not None), None)
    if torch.is_grad_enabled():
        if match is None:
            store.full_rows += len(input_ids)
        else:
            store.replayed_rows += len(input_ids)
    return match


def _match(record: Record, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> Match | None:
    """:func:`find` in one record: every row's prompt (its tokens and padding) and its
    fed completion tokens (up to the last column, which is never fed) equal a recorded
    row's."""
    width = record.prompt_ids.shape[1]
    fed = ids.shape[1] - prompt_len - 1
    if not record.ready or prompt_len > width or fed > record.fed or ids.device != record.tokens.device:
        return None
    n = record.repeats
    kept_mask = record.prompt_mask.repeat_interleave(n, 0)
    kept = torch.cat([record.prompt_ids.repeat_interleave(n, 0)[:, width - prompt_len:],
                      record.tokens[:, :fed]], dim=1)  # [R, P + fed]
    valid = mask[:, : prompt_len + fed].bool()
    same_tokens = ((kept[None] == ids[:, None, : prompt_len + fed]) | ~valid[:, None]).all(-1)  # [B, R]
    # the same prompt padding, and no recorded prompt token left of the prompt_len columns
    same_prompt = ((kept_mask[None, :, width - prompt_len:] == mask[:, None, :prompt_len]).all(-1)
                   & (kept_mask[:, : width - prompt_len].sum(1) == 0)[None])
    same = same_tokens & same_prompt
    if not bool(same.any(1).all()):
        return None
    return Match(record, same.int().argmax(1))


def gather(match: Match, layer: int, prompt_rows: torch.Tensor | None, prompt_len: int, fed: int,
           whole_rows: bool) -> tuple[torch.Tensor, ...]:
    """One layer's kept outputs in the lean forward's flat token order: with
    ``whole_rows`` each row's prompt then its ``fed`` tokens; otherwise the prompts of
    the micro-batch's rows ``prompt_rows`` (one per group), then every row's fed tokens."""
    record, rows = match.record, match.rows
    kept = record.layers[layer]
    width = record.prompt_ids.shape[1]
    units = rows // record.repeats  # each row's prompt in the record
    prompts = units if whole_rows else units.index_select(0, prompt_rows)
    out = []
    for prompt, steps in zip(kept.prompt, kept.steps):
        prompt = prompt[:, width - prompt_len:].index_select(0, prompts)
        steps = steps[:, :fed].index_select(0, rows)
        parts = [prompt, steps] if whole_rows else [prompt.flatten(0, 1), steps.flatten(0, 1)]
        flat = torch.cat(parts, dim=1 if whole_rows else 0)
        out.append(flat.reshape(-1, flat.shape[-1]))
    return tuple(out)


class Replayed(torch.autograd.Function):
    """``kept`` standing for ``[residual +] x [W₁; W₂; ...]ᵀ [+ b]`` (the projections'
    outputs side by side), computed by the decode; the backward is that product's:
    ``dx = Σ g_i W_i``, ``dW_i = g_iᵀ x``, ``db_i = Σ g_i``, ``dresidual = g``.
    ``params``: ``W₁, b₁, W₂, b₂, ...`` (a bias may be None)."""

    @staticmethod
    def forward(ctx, kept: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,  # type: ignore[override]
                *params: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, *[p for p in params[::2]])
        ctx.biases = [b is not None for b in params[1::2]]
        ctx.residual = residual is not None
        return kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = None
        grads: list[torch.Tensor | None] = []
        start = 0
        for i, (weight, has_bias) in enumerate(zip(weights, ctx.biases)):
            g = grad[..., start: start + weight.shape[0]]
            start += weight.shape[0]
            if needs[1]:
                grad_x = g @ weight if grad_x is None else grad_x.addmm_(g, weight)
            grads.append(g.t() @ x if needs[3 + 2 * i] else None)
            grads.append(g.sum(0) if has_bias and needs[4 + 2 * i] else None)
        return None, grad_x, grad if ctx.residual else None, *grads


def replayed_metrics(model: nn.Module) -> dict[str, Metric]:
    """``learn/replayed_frac`` of the training rows since the last call (weighted by
    their count), where ``model`` keeps records; nothing otherwise."""
    store = store_of(model)
    if store is None:
        return {}
    replayed, full = store.take_counts()
    total = replayed + full
    return {keys.LEARN_REPLAYED_FRAC: Mean(replayed / total, float(total))} if total else {}
