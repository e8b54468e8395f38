"""A lean incremental decoder for the Llama-family layout, on the model's own tensors.

For small models the per-token cost of a transformers forward is mostly Python around
the matmuls: module-call wrappers, output records, config look-ups and mask building.
:class:`LeanDecoder` runs the same arithmetic as the HF forward of ``Qwen2ForCausalLM``,
``LlamaForCausalLM`` and ``MistralForCausalLM``::

    h = embed(ids)
    per layer:  a = RMSNorm(h);  q, k, v = a Wq + bq, a Wk + bk, a Wv + bv
                q, k = rope(q), rope(k)               (rotate-half, HF's cos/sin)
                h = h + softmax(q kᵀ · scale + mask) v Wo (+ bo)   (grouped-query)
                m = RMSNorm(h);  h = h + (silu(m Wg) ⊙ m Wu) Wd
    logits = RMSNorm(h) W_lm

reading the parameter tensors from the model at each :meth:`LeanDecoder.prefill`, with
one preallocated KV cache tensor per layer ``[R, kv_heads, P + max_new_tokens - 1,
head_dim]`` written in place (the last sampled token is never fed back). Rows are left
padded: padded key positions are masked, and positions count real tokens only
(``cumsum(mask) - 1``), as the generator's HF path passes them.

:func:`~rltune.models.dense_layout.supports_fastpath` admits a model only when every
feature of its config is one this file implements; anything else (rope scaling, sliding
windows, other activations, adapters that replace the projection modules, registered
hooks) goes through HF. The layer's tensors, RMSNorm and rotary arithmetic are shared
with the learner's training forward (:mod:`rltune.models.dense_layout`).

Fused projections. Each prefill concatenates every layer's ``Wq, Wk, Wv`` (and biases)
into one ``[(Hq + 2 Hkv) D, H]`` matrix and ``Wg, Wu`` into one ``[2 I, H]``, so a layer
runs four matrix products instead of seven (the same dot products: each output is still
one row of ``W`` times ``a``). On a CPU in float32 without autocast the four matrices are
also packed once (:func:`packed_kernel`). Up to :data:`FEW_ROWS` decode rows they go into
the panels of :mod:`rltune.rollout.fewrows`, whose kernel streams them faster than
oneDNN's product or ``F.linear`` on the same weights (``docs/performance.md``; q/k/v
and gate/up are packed from their own tensors, not concatenated first); above that, or
where that kernel cannot be built, into oneDNN's blocked layout for the decode's row
count (``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's CPU freezing
uses), whose GEMM is faster once the product is compute-bound. Only the float32
summation order changes. On the fewrows panels a one-token step runs each layer as one
native call (:func:`~rltune.rollout.fewrows.decode_layer`), the same arithmetic without
an ATen dispatch for each of its norms, rotations, attention and activation: 17-21 %
off a 25 M decode step (``docs/performance.md``). On a CPU without
packing (bf16, autocast) the products stay separate: concatenated but unpacked they were
0-7 % slower there. They are rebuilt
at every prefill, i.e. once per generate call, from the live parameters: in an RL loop
the learner changes the weights between any two calls, and a cache keyed on tensor
version counters would miss a fused AdamW step, which does not bump them (measured on
torch 2.13). A weight changed between two steps of one generation is not seen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from rltune.models import replay
from rltune.models.dense_layout import LayerTensors, layer_tensors, rms_norm, rotate, supports_fastpath
from rltune.rollout import fewrows

if TYPE_CHECKING:
    from rltune.rollout.compiled import CompiledStep

log = logging.getLogger(__name__)


class _Linear:
    """``y = x Wᵀ + b`` on a weight fixed for one generation, ``W`` the ``weights``
    stacked along the outputs: plain (``kernel`` None), or stored once in a packed layout
    for the few-row product: the kernel of :mod:`rltune.rollout.fewrows` (``"fewrows"``,
    which packs the stacked weights without concatenating them first; an input of more
    than :data:`FEW_ROWS` rows, the prefill of a long prompt, goes to ``F.linear`` on the
    live weights instead, which is faster there) or oneDNN's blocked layout for ``rows``
    rows (``"onednn"``)."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None, *, kernel: str | None,
                 rows: int) -> None:
        self.bias = bias
        self.kernel = kernel
        if kernel == "fewrows":
            self.weights = weights
            self.weight = fewrows.pack(weights)
            return
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if kernel == "onednn" else weight

    def _plain(self, x: torch.Tensor) -> torch.Tensor | None:
        """The unpacked weight where a fewrows product gets too many rows for its kernel."""
        if x.numel() <= FEW_ROWS * x.shape[-1]:
            return None
        return self.weights[0] if len(self.weights) == 1 else torch.cat(self.weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fewrows":
            plain = self._plain(x)
            if plain is not None:
                return F.linear(x, plain, self.bias)
            return fewrows.linear(x, self.weight, self.bias)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + (x Wᵀ + b)``; packed, the sum is done by the product's kernel as it
        stores the output (one call, the same float32 addition)."""
        if self.kernel == "fewrows":
            plain = self._plain(x)
            if plain is not None:
                return residual + F.linear(x, plain, self.bias)
            return fewrows.linear(x, self.weight, self.bias, residual)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return residual + F.linear(x, self.weight, self.bias)


class _Projections:
    """Several projections of one input: one product on their concatenated weights whose
    output columns are split (``fuse``), or one product each."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor | None]], *, fuse: bool, kernel: str | None,
                 rows: int) -> None:
        if fuse:
            biases = [b for _, b in pairs]
            bias = None if biases[0] is None else torch.cat(biases)
            self.linears = [_Linear([w for w, _ in pairs], bias, kernel=kernel, rows=rows)]
            self.split: list[int] | None = [w.shape[0] for w, _ in pairs]
        else:
            self.linears = [_Linear([w], b, kernel=kernel, rows=rows) for w, b in pairs]
            self.split = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.split is not None:
            return self.linears[0](x).split(self.split, dim=-1)
        return tuple(linear(x) for linear in self.linears)

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """The projections' outputs side by side in one tensor, ``[..., sum of widths]``."""
        if self.split is not None:
            return self.linears[0](x)
        return torch.cat([linear(x) for linear in self.linears], dim=-1)


@dataclass(frozen=True)
class _Fused:
    """One layer's projections for one generation: ``qkv`` (q, k, v), ``o``,
    ``gate_up`` (gate, up) and ``down``."""

    qkv: _Projections
    o: _Linear
    gate_up: _Projections
    down: _Linear


def _fuse(layer: LayerTensors, *, fuse: bool, kernel: str | None, rows: int) -> _Fused:
    """``layer``'s live weights for one generation: q/k/v and gate/up concatenated when
    ``fuse``, each matrix packed for ``kernel`` (see :class:`_Linear`)."""
    return _Fused(
        qkv=_Projections([layer.q, layer.k, layer.v], fuse=fuse, kernel=kernel, rows=rows),
        o=_Linear([layer.o[0]], layer.o[1], kernel=kernel, rows=rows),
        gate_up=_Projections([(layer.gate, None), (layer.up, None)], fuse=fuse, kernel=kernel, rows=rows),
        down=_Linear([layer.down], None, kernel=kernel, rows=rows),
    )


def cpu_float32(weight: torch.Tensor) -> bool:
    """A float32 weight on the CPU without CPU autocast: where the one-query step's
    attention is written out (see :meth:`LeanDecoder.step`)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether a packed product applies: a float32 CPU weight without CPU autocast (which
    would otherwise run the products in its own dtype), and a packed kernel that runs here
    (:mod:`rltune.rollout.fewrows`, or oneDNN built into torch)."""
    return cpu_float32(weight) and (torch.backends.mkldnn.is_available() or fewrows.unavailable() is None)


KERNELS = ("fewrows", "onednn")
"""The packed products (see :class:`_Linear`)."""

FEW_ROWS = 16
"""Up to this many decode rows the fewrows kernel is the default, above it oneDNN's. A
product of R rows does R/2 flops per weight byte; a CPU core's fused multiply-adds
outrun its share of the memory bandwidth about 8 to 1, so up to ~16 rows the product
waits on the weights (where fewrows streams them faster) and beyond that on arithmetic
(where oneDNN's blocked GEMM is faster). Measured crossover 16-32 rows, oneDNN 15-40 %
faster from 64 (``docs/performance.md``)."""


def packed_kernel(requested: str | None = None, rows: int = 1) -> str:
    """The packed product to run for ``rows`` decode rows: ``requested``, or fewrows up to
    :data:`FEW_ROWS` rows and oneDNN above (each where it runs: where fewrows cannot be
    built oneDNN serves, logged once, and where torch lacks oneDNN fewrows serves any
    rows). A requested kernel that cannot run is an error naming why."""
    if requested not in (None, *KERNELS):
        raise ValueError(f"unknown packed kernel {requested!r}; expected one of {KERNELS}")
    onednn = torch.backends.mkldnn.is_available()
    if requested == "onednn" or (requested is None and rows > FEW_ROWS and onednn):
        if not onednn:
            raise ValueError("the onednn kernel cannot run here: oneDNN is not built into this torch")
        return "onednn"
    reason = fewrows.unavailable()
    if reason is None:
        return "fewrows"
    if requested == "fewrows" or not onednn:
        raise ValueError(f"the fewrows kernel cannot run here: {reason}"
                         + ("" if onednn else ", and oneDNN is not built into this torch"))
    if not _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.append(reason)
        log.warning("the decoder's products use oneDNN's packed kernel: the fewrows kernel cannot "
                    "run here (%s)", reason)
    return "onednn"


_FALLBACK_LOGGED: list[str] = []


class LeanDecoder:
    """Prefill then one-token steps over ``model``'s weights; see the module docstring.

    ``prefill(ids [U, P], mask [U, P], repeats=n) -> logits [R, V]`` (last position,
    ``R = U n`` rows), then up to
    ``max_new_tokens - 1`` calls of ``step(tokens [R]) -> logits [R, V]``. Logits are in
    the model's dtype. Call under ``torch.inference_mode()``.
    """

    def __init__(self, model: PreTrainedModel, *, max_new_tokens: int,
                 compiled: "CompiledStep | None" = None, pack: bool | None = None,
                 kernel: str | None = None, keep_forward: bool = False) -> None:
        """``compiled``: take the steps with that compiled step over its static cache
        (``rollout.compile``, :mod:`rltune.rollout.compiled`) instead of eagerly.
        ``pack``: run the fused projections on packed weights (see the module
        docstring); None: where :func:`can_pack` allows; True where it does not is an
        error. ``kernel``: the packed product (:func:`packed_kernel`; None: by the row
        count, among those that run here); naming one implies ``pack=True``.
        ``keep_forward``: keep each token's projection outputs for the learner's forward
        (:mod:`rltune.models.replay`), where the model keeps records, in float32 without
        autocast."""
        if not supports_fastpath(model):
            raise ValueError(f"{type(model).__name__} with this config is not supported by LeanDecoder")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        inner = model.model
        attn = inner.layers[0].self_attn
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.layers = [layer_tensors(layer) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scale = attn.scaling
        self.compiled = compiled
        if kernel is not None and pack is None:
            pack = True  # a named packed product is a request to pack
        if pack and not cpu_float32(self.embed):
            raise ValueError("LeanDecoder(pack=True) needs float32 weights on the CPU and no CPU "
                             f"autocast; got {self.embed.dtype} on {self.embed.device}, "
                             f"autocast {torch.is_autocast_enabled('cpu')}")
        if kernel is not None and pack is False:
            raise ValueError(f"LeanDecoder(kernel={kernel!r}) names a packed product, but pack=False")
        self.kernel = packed_kernel(kernel) if kernel is not None else None  # None: by rows, at the prefill
        self.pack = pack
        self.fused: list[_Fused] = []
        self.key_bias: torch.Tensor | None = None
        self.keep_forward = keep_forward
        self.record: replay.Record | None = None
        self.native = False
        self._t = 0

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, *, repeats: int = 1) -> torch.Tensor:
        """Run the prompts ``ids [U, P]``, fill the caches; logits of the last position
        ``[U repeats, V]``. With ``repeats > 1`` each prompt runs once and its cache is
        copied to ``repeats`` adjacent rows (the ``n`` samples of a prompt share it), which
        saves ``1 - 1/repeats`` of the prefill's compute."""
        logits = self._prefill(ids, mask, repeats)
        if repeats > 1:
            self.keys = [k.repeat_interleave(repeats, 0) for k in self.keys]
            self.values = [v.repeat_interleave(repeats, 0) for v in self.values]
            self.valid = self.valid.repeat_interleave(repeats, 0)
            self.cos, self.sin = self.cos.repeat_interleave(repeats, 0), self.sin.repeat_interleave(repeats, 0)
            logits = logits.repeat_interleave(repeats, 0)
        if cpu_float32(self.embed):
            # the one-query step's additive key mask (eager, and the compiled packed step's
            # table), one row per (row, kv head) as its batched products lay them out: 0
            # where a key is valid, -inf where padded
            kv_heads = self.keys[0].shape[1]
            bias = torch.zeros(self.valid.shape, dtype=self.embed.dtype, device=self.embed.device)
            self.key_bias = bias.masked_fill_(~self.valid, float("-inf")).repeat_interleave(kv_heads, 0)[:, None]
        else:
            self.key_bias = None
        if self.compiled is not None:
            self.compiled.begin(self)
        return logits

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int) -> torch.Tensor:
        rows, width = ids.shape
        steps = self.max_new_tokens - 1
        total = width + steps
        # this generation's weights: the live parameters, fused (packed, the compiled step
        # on a CPU reads them too; otherwise it reads the parameters itself)
        pack = self.pack if self.pack is not None else can_pack(self.embed)
        kernel = (self.kernel or packed_kernel(rows=rows * repeats)) if pack else None
        # on a CPU the concatenation pays only with packing (measured: without it the
        # fused products are 0-7 % slower than separate ones); elsewhere it saves launches
        fuse = pack or self.embed.device.type != "cpu"
        self.fused = [_fuse(layer, fuse=fuse, kernel=kernel, rows=rows * repeats) for layer in self.layers]
        # every product on fewrows' panels: the one-query step runs a layer in one native call
        self.native = kernel == "fewrows"
        x = F.embedding(ids, self.embed)
        kv_heads = self.layers[0].k[0].shape[0] // self.head_dim
        shape = (rows, kv_heads, total, self.head_dim)
        self.keys = [x.new_empty(shape) for _ in self.layers]
        self.values = [x.new_empty(shape) for _ in self.layers]
        valid = mask.bool()
        # Key validity for the whole run: prompt padding masked, every new token kept.
        self.valid = torch.cat([valid, valid.new_ones(rows, steps)], dim=1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        # cos/sin of every later step's position too, in one call: all elementwise.
        ahead = positions[:, -1:] + torch.arange(1, steps + 1, device=ids.device)
        cos, sin = self.model.model.rotary_emb(x, torch.cat([positions, ahead], dim=1))
        self.cos, self.sin = cos.unsqueeze(1), sin.unsqueeze(1)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        # A padded query sees itself only: a fully masked row would give NaN, which would
        # then reach real rows through 0 · NaN in the attention-weighted sum of values.
        attend = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids.device)
        self._t = width
        self.record = None
        if self.keep_forward and self.embed.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
            layer = self.layers[0]
            widths = (sum(w.shape[0] for w, _ in (layer.q, layer.k, layer.v)), x.shape[-1],
                      2 * layer.gate.shape[0], x.shape[-1])
            self.record = replay.start_record(self.model, ids, mask, repeats, steps, widths, len(self.layers))
        h = self._forward(x, attend.unsqueeze(1), 0, width)
        if self.record is not None:
            self.record.ready = True
        return F.linear(rms_norm(h[:, -1], self.norm, self.norm_eps), self.lm_head)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ``tokens [R]``; logits of the next ``[R, V]``."""
        t = self._t
        if t >= self.valid.shape[1]:
            raise ValueError(f"LeanDecoder was sized for {self.max_new_tokens} new tokens, so "
                f"{self.max_new_tokens - 1} steps after the prefill; step called past that")
        if self.record is not None:
            self.record.tokens[:, t - self.record.prompt_ids.shape[1]] = tokens
        if self.compiled is not None:
            logits = self.compiled.step(self, tokens)
        elif self.key_bias is not None:
            h = self._one_query(F.embedding(tokens, self.embed), t)
            logits = F.linear(F.rms_norm(h, (h.shape[-1],), self.norm, self.norm_eps), self.lm_head)
        else:
            x = F.embedding(tokens.unsqueeze(-1), self.embed)
            h = self._forward(x, self.valid[:, None, None, : t + 1], t, t + 1)
            logits = F.linear(rms_norm(h[:, -1], self.norm, self.norm_eps), self.lm_head)
        self._t = t + 1
        if self.record is not None:
            self.record.fed += 1
        return logits

    def _forward(self, h: torch.Tensor, attend: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Positions ``start:end`` through every layer; ``attend [R, 1, T|1, end]`` bool."""
        cos, sin = self.cos[:, :, start:end], self.sin[:, :, start:end]
        for index, (layer, fused, keys, values) in enumerate(zip(self.layers, self.fused, self.keys, self.values)):
            qkv = fused.qkv(rms_norm(h, layer.norm1, layer.eps1))
            after_attention = h + self._attention(qkv, fused, keys, values, cos, sin, attend, start, end)
            gate, up = fused.gate_up(rms_norm(after_attention, layer.norm2, layer.eps2))
            h = after_attention + fused.down(F.silu(gate) * up)
            if self.record is not None:
                outputs = (torch.cat(qkv, -1), after_attention, torch.cat((gate, up), -1), h)
                (self.record.put_prompt if start == 0 else self.record.put_step)(index, outputs)
        return h

    def _one_query(self, h: torch.Tensor, t: int) -> torch.Tensor:
        """Position ``t`` of every row through every layer, on a CPU in float32: ``h [R, H]``.

        :meth:`_forward`'s arithmetic for one query, in fewer and cheaper calls, which is
        what a small model's decode step costs on a CPU; on fewrows-packed weights each
        layer is one native call instead (:meth:`_native_layers`). The attention is two batched
        products over the cache, with (row, kv head) pairs as the batch and a kv head's
        group of query heads as its rows: the first (``baddbmm``) adds the padded keys'
        ``-inf``, a softmax runs between them. SDPA's CPU kernel costs several times that
        at one query, and more with two threads. q and k are rotated in one call, the
        norms are ``F.rms_norm`` (HF's float32 RMSNorm arithmetic in one call from
        Python), and when packed the residual additions are the o and down products'
        post-op.
        """
        rows, width = h.shape
        kv_heads = self.keys[0].shape[1]
        q_heads = kv_heads * self.groups
        cos, sin = self.cos[:, :, t], self.sin[:, :, t]  # [R, 1, D], one row per head
        if self.native and rows <= FEW_ROWS:
            return self._native_layers(h, t, cos[:, 0].contiguous(), sin[:, 0].contiguous())
        bias = self.key_bias[:, :, : t + 1]
        for index, (layer, fused, keys, values) in enumerate(zip(self.layers, self.fused, self.keys, self.values)):
            a = F.rms_norm(h, (width,), layer.norm1, layer.eps1)
            heads = fused.qkv.joined(a).view(rows, -1, self.head_dim)
            qk = rotate(heads[:, : q_heads + kv_heads], cos, sin)  # q and k in one call
            keys[:, :, t] = qk[:, q_heads:]
            values[:, :, t] = heads[:, q_heads + kv_heads:]
            q = qk[:, :q_heads].reshape(rows * kv_heads, self.groups, self.head_dim)
            k_all = keys[:, :, : t + 1].reshape(rows * kv_heads, t + 1, self.head_dim)
            v_all = values[:, :, : t + 1].reshape(rows * kv_heads, t + 1, self.head_dim)
            scores = torch.baddbmm(bias, q, k_all.transpose(1, 2), alpha=self.scale)
            after_attention = fused.o.add_to(torch.bmm(scores.softmax(-1), v_all).view(rows, -1), h)
            gate_up = fused.gate_up.joined(F.rms_norm(after_attention, (width,), layer.norm2, layer.eps2))
            gate, up = gate_up.chunk(2, dim=-1)
            h = fused.down.add_to(F.silu(gate) * up, after_attention)
            if self.record is not None:
                self.record.put_step(index, (heads, after_attention, gate_up, h))
        return h

    def _native_layers(self, h: torch.Tensor, t: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`_one_query`'s layers, each one native call on the fewrows-packed weights
        (:func:`~rltune.rollout.fewrows.decode_layer`: the same arithmetic without an ATen
        dispatch per step of it)."""
        for index, (layer, fused, keys, values) in enumerate(zip(self.layers, self.fused, self.keys, self.values)):
            qkv, gate_up = fused.qkv.linears[0], fused.gate_up.linears[0]
            h, heads, after_attention, joined = fewrows.decode_layer(
                h, layer.norm1, layer.eps1, qkv.weight, qkv.bias, keys, values, self.key_bias, cos, sin, t,
                self.scale, fused.o.weight, fused.o.bias, layer.norm2, layer.eps2, gate_up.weight, fused.down.weight)
            if self.record is not None:
                self.record.put_step(index, (heads.view(h.shape[0], -1, self.head_dim), after_attention, joined, h))
        return h

    def _attention(
        self, qkv: tuple[torch.Tensor, ...], fused: _Fused, keys: torch.Tensor, values: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, attend: torch.Tensor, start: int, end: int,
    ) -> torch.Tensor:
        """Grouped-query attention of the projections ``qkv`` (q, k, v ``[R, T, ...]``) over
        cache slots ``0:end``, after writing this call's keys and values into slots ``start:end``."""
        rows, length, _ = qkv[0].shape
        q, k, v = (part.view(rows, length, -1, self.head_dim).transpose(1, 2) for part in qkv)
        keys[:, :, start:end] = rotate(k, cos, sin)
        values[:, :, start:end] = v
        q = rotate(q, cos, sin)
        k_all, v_all = keys[:, :, :end], values[:, :, :end]
        if length == 1:
            # One query: each kv head's group of query heads becomes its query rows, so no
            # key/value is repeated (what HF's SDPA path does for a decode step).
            out = F.scaled_dot_product_attention(
                q.reshape(rows, -1, self.groups, self.head_dim), k_all, v_all,
                attn_mask=attend, scale=self.scale,
            )
            out = out.reshape(rows, 1, -1)
        else:
            out = F.scaled_dot_product_attention(
                q, k_all, v_all, attn_mask=attend, scale=self.scale, enable_gqa=self.groups > 1,
            )
            out = out.transpose(1, 2).reshape(rows, length, -1)
        return fused.o(out)
