"""A lean, differentiable training forward for the Llama-family layout.

:func:`~rltune.models.logprobs.completion_logprobs` calls the transformers model, whose
forward on small shapes is mostly Python and small ops around the matrix products:
module-call wrappers, mask building, output records, rotary in five ops, separate
prompt and completion passes. :func:`lean_completion_logprobs` computes the same
log-probs and entropy from the same parameters (gradients land on the model's own
``nn.Parameter`` s) with the arithmetic of HF's ``Qwen2ForCausalLM``,
``LlamaForCausalLM`` and ``MistralForCausalLM`` forward written out, the one
:mod:`rltune.rollout.fastpath` runs for generation (see its docstring for the formula).

Every token of the batch is one row of a flat ``[N, H]`` hidden state, so the
token-wise parts (norms, projections, rotary, MLP) are one op per layer over the whole
batch. Where adjacent rows share their prompt (:func:`~rltune.models.shared_prompt.prompt_groups`)
the distinct prompts' tokens and the completions' tokens are rows of the same flat
state: each weight is used in one product (one weight gradient, none added up), and
only the attention is split: the prompts attend among themselves (causal, left padding
masked), the completions to their group's prompt keys (indexed, so each copy's gradient
flows back to the one prompt) and causally to their own. Otherwise whole rows run,
without the last column (it predicts past the end).

Only the hidden states at the completion positions go through the final norm; the head,
temperature and log-softmax are :func:`~rltune.models.chunked.chunked_stats`'s. Blocks
the learner checkpoints (``train.activation_checkpointing``) run under
``torch.utils.checkpoint`` here too. :func:`supports_lean_forward` admits a model only
where this is exactly its forward; :func:`~rltune.models.logprobs.completion_logprobs`
runs it then.

Memory: a training forward saves what the transformers forward saves. Without grad,
one layer's intermediates cover the prompts and the completions at once, where the
transformers shared-prompt forward held one of the two at a time.

Measured (``benchmarks/train_forward_overhead.py time``, process CPU time, one thread,
medians of 7 interleaved rounds): forward+backward with entropy 1.23x faster than the
HF path on the DPO benchmark's batch (16 pairs, ``(32, 10)``) and 1.25x on the GRPO
learner's (8 x 38 tokens) with the 3 M Qwen2; 1.20x and 1.19x with the 25 M one; the
forward alone without grad 1.14-1.33x. The rest is the matrix products (about 70 % of
the step at 3 M). The projections stay separate: q/k/v or gate/up concatenated into one
product (the cat and its backward included) measured 3-10 % slower on the CPU. On the
whole DPO benchmark (``benchmarks/dpo_vs_trl.py``, 3 rounds, a quiet 2-core machine)
rltune went from 1.22x to 1.54x TRL's pairs/s (``docs/performance.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from rltune.models import replay
from rltune.models.chunked import chunked_stats
from rltune.models.dense_layout import LayerTensors, has_hooks, layer_tensors, rms_norm, supports_fastpath
from rltune.models.replay import Replayed
from rltune.models.shared_prompt import _as_ddp_forward, prompt_groups

_CHECKPOINTED = "_rltune_checkpointed"
"""The mark of a block whose training forward ``rltune.learner.memory`` checkpoints."""


def supports_lean_forward(model: nn.Module) -> bool:
    """Whether :func:`lean_completion_logprobs` computes what ``model``'s forward does.

    The generation fast path's conditions (:func:`~rltune.models.dense_layout.supports_fastpath`:
    an unwrapped Qwen2 / Llama / Mistral causal LM, default rope, no sliding window, plain
    ``nn.Linear`` projections, so no LoRA), no forward hooks, no attention dropout while
    training, no module whose ``forward`` was replaced on the instance (a compiled block,
    a patch: the lean path would not run it) but for activation checkpointing's, which it
    does itself (:func:`_body`), and no sharded (DTensor) parameters. Such a model may be
    wrapped in DDP, whose steps before and after a forward then surround this one (as for
    the shared-prompt forward, :mod:`rltune.models.shared_prompt`).
    """
    if isinstance(model, DistributedDataParallel):
        ddp_steps = hasattr(model, "_pre_forward") and hasattr(model, "_post_forward")
        return ddp_steps and supports_lean_forward(model.module)
    if not supports_fastpath(model) or has_hooks(model):
        return False
    if model.training and float(getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    if any("forward" in m.__dict__ and _CHECKPOINTED not in m.__dict__ for m in model.modules()):
        return False
    if any("_rltune_compiled" in m.__dict__ for m in model.modules()):
        return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


def lean_completion_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
    temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy)`` ``[B, C]`` of ``input_ids[:, prompt_len:]``, as
    :func:`~rltune.models.logprobs.completion_logprobs` returns them for a dense model
    (0 on padding; entropy without grad, None unless ``with_entropy``); the layout and
    arguments are its. Raises for a model :func:`supports_lean_forward` refuses."""
    if not supports_lean_forward(model):
        raise ValueError(f"{type(model).__name__} with this config is not supported by the lean forward")
    if isinstance(model, DistributedDataParallel):
        return _as_ddp_forward(model, _stats, input_ids, attention_mask, prompt_len, temperature=temperature,
                               with_entropy=with_entropy, chunk_tokens=chunk_tokens)
    return _stats(model, input_ids, attention_mask, prompt_len, temperature=temperature,
                  with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def _stats(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
           temperature: float, with_entropy: bool, chunk_tokens: int | None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`lean_completion_logprobs` on the (unwrapped) model."""
    hidden = completion_hidden(model, input_ids, attention_mask, prompt_len)
    valid = attention_mask[:, prompt_len:].bool()
    return chunked_stats(model, hidden, input_ids[:, prompt_len:], valid, temperature=temperature,
                         with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def completion_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_len: int) -> torch.Tensor:
    """``[B, C, H]`` final-normed hidden states at positions ``P - 1 .. T - 2`` (those
    that predict the completion), the prompts run once per group where rows share them."""
    groups = prompt_groups(input_ids, attention_mask, prompt_len)
    if groups is None:
        ids, mask = input_ids[:, :-1], attention_mask[:, :-1]
        parts = [_whole_rows(ids, mask)]
    else:
        parts = _shared_parts(input_ids, attention_mask, prompt_len, groups)
    h = _body(model, parts, _kept_forward(model, input_ids, attention_mask, prompt_len, groups))
    inner = model.model
    rows, width = input_ids.shape[0], input_ids.shape[1] - prompt_len
    if groups is None:
        picked = h.view(rows, -1, h.shape[-1])[:, prompt_len - 1:]
    else:
        first = parts[0]
        last = h[: first.tokens].view(first.rows, first.length, -1)[:, -1:].index_select(0, groups)
        picked = last if width == 1 else torch.cat(
            [last, h[first.tokens:].view(rows, width - 1, -1)], dim=1)
    return _norm(picked, inner.norm.weight, inner.norm.variance_epsilon)


class _Part:
    """One attention group of the flat batch: ``rows`` sequences of ``length`` tokens
    (``ids``, ``positions`` ``[rows, length]``), their queries attending to keys made by
    :meth:`keys` (None: their own keys), under ``mask`` (bool, broadcast to
    ``[rows, 1, length, keys]``; None: causal over their own keys)."""

    def __init__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 groups: torch.Tensor | None = None) -> None:
        self.ids, self.positions, self.mask, self.groups = ids, positions, mask, groups
        self.rows, self.length = ids.shape
        self.tokens = self.rows * self.length

    def keys(self, own: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
        """Keys (or values) ``[rows, kv_heads, K, D]``: the prompt's, indexed by group,
        before the part's own, or the part's own alone."""
        if self.groups is None or prompt is None:
            return own
        return torch.cat([prompt.index_select(0, self.groups), own], dim=2)


def _attend_mask(valid: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` bool: causal, padded keys masked; a padded query sees itself (a
    query that sees nothing gives NaN, which would reach other rows' gradients)."""
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | eye).unsqueeze(1)


def _whole_rows(ids: torch.Tensor, mask: torch.Tensor) -> _Part:
    """Whole rows attending to themselves; without left padding the positions are
    ``0 .. L - 1`` and no mask is built (as :func:`~rltune.models.logprobs.completion_logprobs`
    runs the model then: right padding only follows the attended tokens)."""
    # imported here: completion_logprobs may take this path, so its module imports this one
    from rltune.models.logprobs import causal_suffices, position_ids_from_mask

    if causal_suffices(mask):
        positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape[0], -1)
        return _Part(ids, positions, None)
    return _Part(ids, position_ids_from_mask(mask), _attend_mask(mask.bool()))


def _shared_parts(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  groups: torch.Tensor) -> list[_Part]:
    """The distinct prompts (the first row of each group) and, when the completions are
    longer than one token, their columns but the last, attending to the group's prompt."""
    starts = _group_starts(groups)
    prompts = _whole_rows(input_ids[starts, :prompt_len], attention_mask[starts, :prompt_len])
    width = input_ids.shape[1] - prompt_len
    if width == 1:
        return [prompts]
    prompt_valid = attention_mask[starts, :prompt_len].bool().index_select(0, groups)  # [B, P]
    steps = torch.arange(1, width, device=input_ids.device)
    positions = prompts.positions[:, -1:].index_select(0, groups) + steps  # [B, C - 1]
    causal = torch.ones(width - 1, width - 1, dtype=torch.bool, device=input_ids.device).tril()
    mask = torch.cat([prompt_valid[:, None, :].expand(-1, width - 1, -1),
                      causal.expand(len(groups), -1, -1)], dim=2).unsqueeze(1)  # [B, 1, C - 1, P + C - 1]
    return [prompts, _Part(input_ids[:, prompt_len:-1], positions, mask, groups)]


def _group_starts(groups: torch.Tensor) -> torch.Tensor:
    """The first row of each group (``groups``: :func:`prompt_groups`'s)."""
    return torch.cat([groups.new_ones(1), groups[1:] != groups[:-1]]).nonzero().squeeze(1)


_Kept = Callable[[int], tuple[torch.Tensor, ...]]
"""A layer's kept decode outputs in the flat token order (:func:`rltune.models.replay.gather`)."""


def _kept_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  groups: torch.Tensor | None) -> _Kept | None:
    """The generator's record of these rows' forward (:mod:`rltune.models.replay`), where
    one is kept and usable: float32 weights, and no block checkpointed (whose point is
    to keep less)."""
    usable = model.model.embed_tokens.weight.dtype == torch.float32 and not (
        torch.is_grad_enabled() and any(_CHECKPOINTED in m.__dict__ and m.training for m in model.model.layers))
    match = replay.find(model, input_ids, attention_mask, prompt_len, usable=usable)
    if match is None:
        return None
    starts = None if groups is None else _group_starts(groups)
    fed = input_ids.shape[1] - prompt_len - 1
    return functools.partial(replay.gather, match, prompt_rows=starts, prompt_len=prompt_len, fed=fed,
                             whole_rows=groups is None)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: in float32 ``F.rms_norm`` (the same formula, bitwise equal on
    float32 inputs), else the formula with the mean taken in float32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm(x, weight, eps)


def _rope_tables(model: nn.Module, parts: list[_Part], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[N, 1, D]`` of every flat token's position, from the model's own
    rotary module (HF's cos/sin), the first half of ``sin`` negated: rotate-half is then
    ``x cos + roll(x, D/2) sin``."""
    positions = torch.cat([p.positions.reshape(-1) for p in parts])[None]
    cos, sin = model.model.rotary_emb(like, positions)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos[0, :, None], sin[0, :, None]


def _body(model: nn.Module, parts: list[_Part], kept: _Kept | None = None) -> torch.Tensor:
    """``[N, H]`` last hidden states (before the final norm) of every part's tokens, flat;
    with ``kept``, each block's products taken from the generator's record."""
    inner = model.model
    embed = inner.embed_tokens  # its padding_idx row gets no gradient, as in nn.Embedding
    h = F.embedding(torch.cat([p.ids.reshape(-1) for p in parts]), embed.weight, embed.padding_idx)
    cos, sin = _rope_tables(model, parts, h)
    attn = inner.layers[0].self_attn
    head_dim, scale = attn.head_dim, attn.scaling
    for index, module in enumerate(inner.layers):
        if kept is not None:
            h = _replayed_block(layer_tensors(module), h, kept(index), parts=parts, cos=cos, sin=sin,
                                head_dim=head_dim, scale=scale)
            continue
        run = functools.partial(_block, layer_tensors(module), parts=parts, cos=cos, sin=sin,
                                head_dim=head_dim, scale=scale)
        # a checkpointed block keeps only its input; the backward recomputes it (the same
        # arithmetic, so the same gradients), as rltune.learner.memory does for HF's forward
        checkpointed = _CHECKPOINTED in module.__dict__ and module.training and torch.is_grad_enabled()
        h = checkpoint(run, h, use_reentrant=False) if checkpointed else run(h)
    return h


def _block(layer: LayerTensors, h: torch.Tensor, *, parts: list[_Part], cos: torch.Tensor, sin: torch.Tensor,
           head_dim: int, scale: float) -> torch.Tensor:
    """One decoder layer on the flat hidden state ``h [N, H]``."""
    a = _norm(h, layer.norm1, layer.eps1)
    q, k, v = (F.linear(a, *wb).view(a.shape[0], -1, head_dim) for wb in (layer.q, layer.k, layer.v))
    q = q * cos + q.roll(head_dim // 2, -1) * sin
    k = k * cos + k.roll(head_dim // 2, -1) * sin
    h = h + F.linear(_attention(parts, q, k, v, scale), *layer.o)
    m = _norm(h, layer.norm2, layer.eps2)
    return h + F.linear(F.silu(F.linear(m, layer.gate)) * F.linear(m, layer.up), layer.down)


def _replayed_block(layer: LayerTensors, h: torch.Tensor, kept: tuple[torch.Tensor, ...], *, parts: list[_Part],
                    cos: torch.Tensor, sin: torch.Tensor, head_dim: int, scale: float) -> torch.Tensor:
    """:func:`_block` with each product's output (and the residual sums after o and
    down) taken from ``kept`` (the decode's: q/k/v, after attention, gate/up, after the
    MLP); the backward is the products' (:class:`~rltune.models.replay.Replayed`)."""
    qkv, after_attention, gate_up, after_mlp = kept
    a = _norm(h, layer.norm1, layer.eps1)
    widths = [w.shape[0] for w, _ in (layer.q, layer.k, layer.v)]
    q, k, v = (x.view(a.shape[0], -1, head_dim)
               for x in Replayed.apply(qkv, a, None, *layer.q, *layer.k, *layer.v).split(widths, -1))
    q = q * cos + q.roll(head_dim // 2, -1) * sin
    k = k * cos + k.roll(head_dim // 2, -1) * sin
    h = Replayed.apply(after_attention, _attention(parts, q, k, v, scale), h, *layer.o)
    m = _norm(h, layer.norm2, layer.eps2)
    gate, up = Replayed.apply(gate_up, m, None, layer.gate, None, layer.up, None).chunk(2, -1)
    return Replayed.apply(after_mlp, F.silu(gate) * up, h, layer.down, None)


def _attention(parts: list[_Part], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Grouped-query attention of each part; ``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` flat,
    rotated; returns ``[N, Hq D]``."""
    outs, start = [], 0
    prompt_k = prompt_v = None
    for part in parts:
        end = start + part.tokens
        q_p, k_p, v_p = (x[start:end].view(part.rows, part.length, -1, x.shape[-1]).transpose(1, 2)
                         for x in (q, k, v))
        gqa = q_p.shape[1] != k_p.shape[1]
        keys, values = part.keys(k_p, prompt_k), part.keys(v_p, prompt_v)
        out = F.scaled_dot_product_attention(q_p, keys, values, attn_mask=part.mask, is_causal=part.mask is None,
                                             scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(part.tokens, -1))
        if part.groups is None:
            prompt_k, prompt_v = k_p, v_p
        start = end
    return outs[0] if len(outs) == 1 else torch.cat(outs)
