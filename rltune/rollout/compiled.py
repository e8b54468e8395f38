"""``rollout.compile``: the lean decoder's one-token step, compiled over a static KV cache.

A compiled graph is specialised to its input shapes, and the lean decoder's eager step
reads a cache that grows by one slot a token (``keys[:, :, :t + 1]``): compiled as it is,
every token would be a new graph. :class:`CompiledStep` keeps instead one cache of fixed
size per layer, ``[R, kv_heads, S, head_dim]`` with ``S`` the prompt width plus the new
tokens rounded up to a multiple of :data:`BUCKET`, and every step attends over all ``S``
slots with a mask (valid prompt slots, and slots up to the current one). The step's
inputs are then the same shapes at every token, and at every batch whose rows and
bucket are the same: one graph for a run whose batches have the same number of rows and
prompts of similar width. The slot to write is a tensor, not a Python int, for the same
reason.

The buffers (caches, masks, rotary tables) are allocated once and reused by every later
batch of the same shape, and marked as static addresses, which is what lets CUDA graphs
(``mode="reduce-overhead"`` on a GPU) replay the step: a CUDA graph reads and writes
fixed addresses. On a CPU the step is compiled by inductor's C++ backend without graphs.

The arithmetic is the eager step's (:class:`~rltune.rollout.fastpath.LeanDecoder`), on
the model's live parameters (passed in at each call, so optimizer updates are seen); the
masked slots hold zeros, never garbage, so that ``0 × value`` in the attention sum stays
0. Only the order of float reductions may differ from eager.

Where it pays is measured in ``docs/performance.md`` (on a 2-core CPU it does not: the
decode of a small model is bound by its matmuls, which compilation leaves to the same
BLAS; hence ``rollout.compile: false`` by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from rltune.models.dense_layout import rms_norm, rotate

if TYPE_CHECKING:
    from rltune.rollout.fastpath import LeanDecoder

BUCKET = 64
"""Cache slots are allocated in multiples of this, so prompts of nearby widths share a graph."""

_COMPILED: dict[str | None, Callable[..., torch.Tensor]] = {}


def compile_mode(device: torch.device) -> str | None:
    """``reduce-overhead`` (CUDA graphs) on a GPU; inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def compiled_step_fn(mode: str | None) -> Callable[..., torch.Tensor]:
    """The process's one compiled :func:`static_step` for ``mode`` (compiled lazily, on
    its first call; later calls with the same shapes reuse the graph)."""
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(static_step, dynamic=False, mode=mode)
    return _COMPILED[mode]


def static_step(
    tokens: torch.Tensor, slot: torch.Tensor, embed: torch.Tensor, layers: tuple[tuple[Any, ...], ...],
    head: tuple[torch.Tensor, float, torch.Tensor], caches: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], shape: tuple[int, int, float],
) -> torch.Tensor:
    """One decode step of ``tokens [R]`` at cache slot ``slot`` (0-dim long) over the whole
    static cache; returns the next logits ``[R, V]``. ``layers``: per layer ``(norm1, eps1,
    q, k, v, o, norm2, eps2, gate, up, down)`` with ``q..o`` as ``(weight, bias)``;
    ``head``: ``(norm, eps, lm_head)``; ``caches``: per layer ``(keys, values)``, written
    in place; ``tables``: ``(valid [R, S] bool, cos, sin [R, 1, S, D])``; ``shape``:
    ``(head_dim, query groups per kv head, attention scale)``."""
    valid, cos_all, sin_all = tables
    head_dim, groups, scale = shape
    rows = tokens.shape[0]
    index = slot.view(1)
    cos, sin = cos_all.index_select(2, index), sin_all.index_select(2, index)
    attend = (valid & (torch.arange(valid.shape[1], device=valid.device) <= slot))[:, None, None, :]
    h = F.embedding(tokens.unsqueeze(-1), embed)
    for (norm1, eps1, q_w, k_w, v_w, o_w, norm2, eps2, gate, up, down), (keys, values) in zip(layers, caches):
        a = rms_norm(h, norm1, eps1)
        q = F.linear(a, *q_w).view(rows, 1, -1, head_dim).transpose(1, 2)
        k = F.linear(a, *k_w).view(rows, 1, -1, head_dim).transpose(1, 2)
        v = F.linear(a, *v_w).view(rows, 1, -1, head_dim).transpose(1, 2)
        keys.index_copy_(2, index, rotate(k, cos, sin))
        values.index_copy_(2, index, v)
        q = rotate(q, cos, sin).reshape(rows, -1, groups, head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=scale)
        h = h + F.linear(out.reshape(rows, 1, -1), *o_w)
        m = rms_norm(h, norm2, eps2)
        h = h + F.linear(F.silu(F.linear(m, gate)) * F.linear(m, up), down)
    norm, eps, lm_head = head
    return F.linear(rms_norm(h[:, -1], norm, eps), lm_head)


class CompiledStep:
    """The static buffers and the compiled step of one generator (see the module
    docstring). :meth:`begin` takes over a :class:`LeanDecoder`'s prefilled state,
    :meth:`step` replaces its eager step."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.caches: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self.tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.slot: torch.Tensor | None = None

    def begin(self, decoder: "LeanDecoder") -> None:
        """Copy ``decoder``'s prefilled caches, key mask and rotary tables into the static
        buffers (allocated on the first batch of this shape); the slots past the prompt
        are zeroed."""
        keys = decoder.keys[0]
        rows, kv_heads, length, head_dim = keys.shape
        total = -(-length // BUCKET) * BUCKET
        key = (rows, kv_heads, total, head_dim, len(decoder.keys), keys.dtype, keys.device,
               decoder.cos.dtype)
        if key != self._key:
            self._allocate(key)
        prompt = decoder._t
        for (k_buf, v_buf), k, v in zip(self.caches, decoder.keys, decoder.values):
            for buf, src in ((k_buf, k), (v_buf, v)):
                buf[:, :, :prompt].copy_(src[:, :, :prompt])
                buf[:, :, prompt:].zero_()
        valid, cos, sin = self.tables
        valid.zero_()
        valid[:, :length].copy_(decoder.valid)
        cos[:, :, :length].copy_(decoder.cos)
        sin[:, :, :length].copy_(decoder.sin)

    def _allocate(self, key: tuple) -> None:
        rows, kv_heads, total, head_dim, layers, dtype, device, table_dtype = key
        shape = (rows, kv_heads, total, head_dim)
        self.caches = tuple(
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(layers)
        )
        table = (rows, 1, total, head_dim)
        self.tables = (
            torch.zeros((rows, total), dtype=torch.bool, device=device),
            torch.zeros(table, dtype=table_dtype, device=device),
            torch.zeros(table, dtype=table_dtype, device=device),
        )
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        for buf in (*(t for pair in self.caches for t in pair), *self.tables, self.slot):
            torch._dynamo.mark_static_address(buf)
        self._key = key

    def step(self, decoder: "LeanDecoder", tokens: torch.Tensor) -> torch.Tensor:
        """The next logits ``[R, V]`` after ``tokens [R]`` at ``decoder``'s current slot."""
        self.slot.fill_(decoder._t)
        layers = tuple(
            (l.norm1, l.eps1, l.q, l.k, l.v, l.o, l.norm2, l.eps2, l.gate, l.up, l.down) for l in decoder.layers
        )
        head = (decoder.norm, decoder.norm_eps, decoder.lm_head)
        shape = (decoder.head_dim, decoder.groups, decoder.scale)
        mode = compile_mode(tokens.device)
        logits = compiled_step_fn(mode)(tokens, self.slot, decoder.embed, layers, head, self.caches, self.tables, shape)
        # a CUDA graph's output lives in the graph's memory and the next replay overwrites it
        return logits.clone() if mode == "reduce-overhead" else logits
