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

On a CPU in float32 (where the eager decoder runs its one-query step on packed weights:
the fewrows kernel's, :mod:`rltune.rollout.fewrows`, or oneDNN's) the compiled step is
:func:`packed_step`: that eager step's arithmetic (the packed products with the residual
added as they store their output, the attention as ``baddbmm``, softmax, ``bmm`` with an
additive key mask) over the static cache, compiled with inductor's C++ wrapper, so a
whole step is one native call: the fused norms, rotary and softmax loops and the packed
products run without a Python call between them (fewrows' products are torch operators
registered in C++, called from the generated code through the dispatcher). Inductor
lowers oneDNN's packed products only for weights frozen into a graph as constants (its
CPU freezing); here the packed weights are graph inputs, re-packed from the live
parameters at every generation, so while the step compiles they are lowered as plain
calls of the same kernel (:func:`_lower_packed_products_as_calls`).

Where it pays is measured in ``docs/performance.md``. On a 2-core CPU the packed step
cut a small model's decode by 27 % a token at 3 M parameters and by 14 % at 25 M on
oneDNN's products (with fewrows' products, see that page's Change 7), after
a first compile of about 20 s (inductor caches it on disk for later runs; each new
(rows, bucket) shape compiles again); it needs a C++ compiler, as inductor's CPU backend
always does. ``rollout.compile`` stays ``false`` by default: a short run does not
recover the compile.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from rltune.config import ConfigError
from rltune.models.dense_layout import rms_norm, rotate

if TYPE_CHECKING:
    from rltune.rollout.fastpath import LeanDecoder

BUCKET = 64
"""Cache slots are allocated in multiples of this, so prompts of nearby widths share a graph."""

_COMPILED: dict[Any, Callable[..., torch.Tensor]] = {}


def cpp_compiler_problem() -> str | None:
    """Why inductor's CPU backend could not compile in this process (None when it can):
    no working C++ compiler where inductor looks for one (``torch._inductor.cpp_builder.
    get_cpp_compiler``: the entries of ``torch._inductor.config.cpp.cxx``, from ``CXX``,
    else ``g++``, each run with ``--version``). Looked up once per process; a torch
    without that function is not checked (None)."""
    with _CPP_LOCK:
        if "problem" not in _CPP_COMPILER:
            _CPP_COMPILER["problem"] = _find_cpp_compiler()
        return _CPP_COMPILER["problem"]


def _find_cpp_compiler() -> str | None:
    try:
        from torch._inductor import config, cpp_builder, exc

        find, missing = cpp_builder.get_cpp_compiler, exc.InvalidCxxCompiler
    except (ImportError, AttributeError):
        return None
    try:
        find()
    except missing:
        cxx = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        tried = ", ".join(str(c) for c in cxx if c) or "none"
        source = ", from CXX" if "CXX" in os.environ else "; CXX is unset"
        return f"no working C++ compiler was found (tried {tried}{source})"
    return None


def require_cpp_compiler(key: str, device: torch.device | str) -> None:
    """Raise a ``ConfigError`` naming ``key`` (``rollout.compile``, ``train.compile``) when
    ``device`` is the CPU and :func:`cpp_compiler_problem` finds no compiler there: told at
    start, not as inductor's traceback at the first compiled call. Other devices compile
    without a C++ compiler of this machine's (Triton on CUDA) and are not checked."""
    if torch.device(device).type != "cpu":
        return
    problem = cpp_compiler_problem()
    if problem is not None:
        raise ConfigError(f"{key}=true compiles with torch inductor's C++ backend on the CPU, but {problem}; "
                          f"install g++ or set CXX to a working C++ compiler, or set {key}=false")


def compile_mode(device: torch.device) -> str | None:
    """``reduce-overhead`` (CUDA graphs) on a GPU; inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def compiled_step_fn(mode: str | None) -> Callable[..., torch.Tensor]:
    """The process's one compiled :func:`static_step` for ``mode`` (compiled lazily, on
    its first call; later calls with the same shapes reuse the graph)."""
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(static_step, dynamic=False, mode=mode)
    return _COMPILED[mode]


def compiled_packed_fn() -> Callable[..., torch.Tensor]:
    """The process's compiled :func:`packed_step` for this thread's torch thread count:
    inductor's CPU backend with its C++ wrapper (one native call a step), the packed
    products lowered as kernel calls. Inductor writes the thread count of the compiling
    thread into its generated loops, so a generator thread with its own share of the
    cores (``rollout.threads``) gets its own graph."""
    key = ("packed", torch.get_num_threads())
    with _SETUP_LOCK:
        if key not in _COMPILED:
            _register_binary_fake()
            _lower_packed_products_as_calls()
            _COMPILED[key] = torch.compile(packed_step, dynamic=False, options={"cpp_wrapper": True})
        return _COMPILED[key]


def _lower_packed_products_as_calls() -> None:
    """Make inductor lower oneDNN's packed products (``mkldnn::_linear_pointwise`` and its
    ``binary`` form) as calls of their kernel (fallback kernels), for this process.

    Inductor's own lowering of them serves its CPU freezing, where the packed weight is a
    constant folded into the graph, and asserts that it is one; :func:`packed_step` takes
    the packed weights as inputs instead. The replacement calls the same kernel with the
    same arguments. A graph frozen with inductor later in this process would get these
    calls instead of inductor's lowering, which has not been tested; rltune itself
    freezes no graph (``train.compile`` does not freeze). Swapping the table only around
    this step's calls would leave it wrong for another thread compiling at the same
    time, so it is replaced once, under :data:`_SETUP_LOCK`."""
    from torch._inductor import lowering

    for op in _PACKED_PRODUCTS:
        if op not in _AS_CALLS:
            lowering.lowerings.pop(op, None)
            lowering.make_fallback(op, warn=False)
            _AS_CALLS.add(op)


_PACKED_PRODUCTS = (torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary)
_SETUP_LOCK = threading.Lock()
"""Held while the packed step's compiler set-up runs, so two threads' first calls do not race."""
_AS_CALLS: set[Any] = set()
_CPP_COMPILER: dict[str, str | None] = {}
""":func:`cpp_compiler_problem`'s answer, once looked up (under :data:`_CPP_LOCK`)."""
_CPP_LOCK = threading.Lock()


def linear_add_fake(x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                    attr: str) -> torch.Tensor:
    """The shape of ``mkldnn::_linear_pointwise.binary``'s output: a new contiguous tensor
    of ``x``'s dtype, ``x``'s leading sizes and ``w``'s output features (as the kernel
    returns it, and as torch's shape function of the unary form says)."""
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _register_binary_fake() -> None:
    """Register :func:`linear_add_fake` as the shape function (fake kernel) of
    ``mkldnn::_linear_pointwise.binary``, which torch lacks (the unary form has one)."""
    name = "mkldnn::_linear_pointwise.binary"
    if name in _FAKES or torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return
    torch.library.register_fake(name)(linear_add_fake)
    _FAKES.add(name)


_FAKES: set[str] = set()


def static_step(
    tokens: torch.Tensor, slot: torch.Tensor, embed: torch.Tensor, layers: tuple[tuple[Any, ...], ...],
    head: tuple[torch.Tensor, float, torch.Tensor], caches: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], shape: tuple[int, int, float, bool],
) -> torch.Tensor | tuple[torch.Tensor, tuple[tuple[torch.Tensor, ...], ...]]:
    """One decode step of ``tokens [R]`` at cache slot ``slot`` (0-dim long) over the whole
    static cache; returns the next logits ``[R, V]``, and with ``keep`` (the last of
    ``shape``) each layer's outputs for the learner (:mod:`rltune.models.replay`: q/k/v,
    after attention, gate/up, after the MLP). ``layers``: per layer ``(norm1, eps1,
    q, k, v, o, norm2, eps2, gate, up, down)`` with ``q..o`` as ``(weight, bias)``;
    ``head``: ``(norm, eps, lm_head)``; ``caches``: per layer ``(keys, values)``, written
    in place; ``tables``: ``(valid [R, S] bool, cos, sin [R, 1, S, D])``; ``shape``:
    ``(head_dim, query groups per kv head, attention scale, keep)``."""
    valid, cos_all, sin_all = tables
    head_dim, groups, scale, keep = shape
    rows = tokens.shape[0]
    index = slot.view(1)
    cos, sin = cos_all.index_select(2, index), sin_all.index_select(2, index)
    attend = (valid & (torch.arange(valid.shape[1], device=valid.device) <= slot))[:, None, None, :]
    h = F.embedding(tokens.unsqueeze(-1), embed)
    kept = []
    for (norm1, eps1, q_w, k_w, v_w, o_w, norm2, eps2, gate, up, down), (keys, values) in zip(layers, caches):
        a = rms_norm(h, norm1, eps1)
        projected = [F.linear(a, *w) for w in (q_w, k_w, v_w)]
        q, k, v = (x.view(rows, 1, -1, head_dim).transpose(1, 2) for x in projected)
        keys.index_copy_(2, index, rotate(k, cos, sin))
        values.index_copy_(2, index, v)
        q = rotate(q, cos, sin).reshape(rows, -1, groups, head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=scale)
        after_attention = h + F.linear(out.reshape(rows, 1, -1), *o_w)
        m = rms_norm(after_attention, norm2, eps2)
        gated, upped = F.linear(m, gate), F.linear(m, up)
        h = after_attention + F.linear(F.silu(gated) * upped, down)
        if keep:
            kept.append((torch.cat(projected, -1), after_attention, torch.cat((gated, upped), -1), h))
    norm, eps, lm_head = head
    logits = F.linear(rms_norm(h[:, -1], norm, eps), lm_head)
    return (logits, tuple(kept)) if keep else logits


def packed_step(
    tokens: torch.Tensor, slot: torch.Tensor, embed: torch.Tensor, layers: tuple[tuple[Any, ...], ...],
    head: tuple[torch.Tensor, float, torch.Tensor], caches: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], shape: tuple[int, int, float, int, str, bool],
) -> torch.Tensor | tuple[torch.Tensor, tuple[tuple[torch.Tensor, ...], ...]]:
    """:func:`static_step` on a CPU in float32, in the form of the eager one-query step
    (``LeanDecoder._one_query``): ``layers`` per layer ``(norm1, eps1, qkv, qkv_bias, o,
    o_bias, norm2, eps2, gate_up, down)``, the fused weights packed for ``kernel``;
    ``tables``: ``(key_bias [R kv_heads, 1, S], cos, sin [R, 1, S, D])``, the bias 0 at
    a valid or later slot and ``-inf`` at a padded prompt slot; ``shape``: ``(head_dim,
    query groups per kv head, attention scale, kv heads, kernel, keep)``, the kernel
    ``"fewrows"`` or ``"onednn"`` (:class:`~rltune.rollout.fastpath._Linear`), ``keep`` as
    :func:`static_step`'s. Slots after ``slot`` get ``-inf`` here."""
    key_bias, cos_all, sin_all = tables
    head_dim, groups, scale, kv_heads, kernel, keep = shape
    rows, width = tokens.shape[0], embed.shape[1]
    q_heads = kv_heads * groups
    slots = key_bias.shape[-1]
    index = slot.view(1)
    cos, sin = cos_all.index_select(2, index)[:, :, 0], sin_all.index_select(2, index)[:, :, 0]
    bias = key_bias + torch.where(torch.arange(slots, device=slot.device) <= slot, 0.0, float("-inf"))
    if kernel == "fewrows":
        def linear(x, w, b, *_):
            return torch.ops.rltune.fewrows_linear(x, w, b)

        def linear_add(x, residual, w, b, _):
            return torch.ops.rltune.fewrows_linear(x, w, b, residual)
    else:
        linear, linear_add = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._linear_pointwise.binary
    h = F.embedding(tokens, embed)
    kept = []
    for (norm1, eps1, qkv, qkv_bias, o, o_bias, norm2, eps2, gate_up, down), (keys, values) in zip(layers, caches):
        a = F.rms_norm(h, (width,), norm1, eps1)
        projected = linear(a, qkv, qkv_bias, "none", [], "")
        heads = projected.view(rows, -1, head_dim)
        qk = rotate(heads[:, : q_heads + kv_heads], cos, sin)  # q and k in one call
        keys.index_copy_(2, index, qk[:, q_heads:].unsqueeze(2))
        values.index_copy_(2, index, heads[:, q_heads + kv_heads:].unsqueeze(2))
        q = qk[:, :q_heads].reshape(rows * kv_heads, groups, head_dim)
        scores = torch.baddbmm(bias, q, keys.view(rows * kv_heads, slots, head_dim).transpose(1, 2), alpha=scale)
        out = torch.bmm(scores.softmax(-1), values.view(rows * kv_heads, slots, head_dim)).view(rows, -1)
        after_attention = linear_add(out, h, o, o_bias, "add")
        gated = linear(F.rms_norm(after_attention, (width,), norm2, eps2), gate_up, None, "none", [], "")
        gate, up = gated.chunk(2, dim=-1)
        h = linear_add(F.silu(gate) * up, after_attention, down, None, "add")
        if keep:
            kept.append((projected, after_attention, gated, h))
    norm, eps, lm_head = head
    logits = F.linear(F.rms_norm(h, (width,), norm, eps), lm_head)
    return (logits, tuple(kept)) if keep else logits


class CompiledStep:
    """The static buffers and the compiled step of one generator (see the module
    docstring). :meth:`begin` takes over a :class:`LeanDecoder`'s prefilled state,
    :meth:`step` replaces its eager step."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        """``device``: the generator's; on the CPU a missing C++ compiler is refused here
        (:func:`require_cpp_compiler`), None checks nothing."""
        if device is not None:
            require_cpp_compiler("rollout.compile", device)
        self._key: tuple | None = None
        self.caches: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self.tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.slot: torch.Tensor | None = None
        self._packed_args: tuple | None = None

    def begin(self, decoder: "LeanDecoder") -> None:
        """Copy ``decoder``'s prefilled caches, key mask and rotary tables into the static
        buffers (allocated on the first batch of this shape); the slots past the prompt
        are zeroed."""
        keys = decoder.keys[0]
        rows, kv_heads, length, head_dim = keys.shape
        total = -(-length // BUCKET) * BUCKET
        packed = _packed_kernel(decoder)
        key = (rows, kv_heads, total, head_dim, len(decoder.keys), keys.dtype, keys.device,
               decoder.cos.dtype, packed)
        if key != self._key:
            self._allocate(key)
        prompt = decoder._t
        for (k_buf, v_buf), k, v in zip(self.caches, decoder.keys, decoder.values):
            for buf, src in ((k_buf, k), (v_buf, v)):
                buf[:, :, :prompt].copy_(src[:, :, :prompt])
                buf[:, :, prompt:].zero_()
        keep, cos, sin = self.tables
        keep.zero_()
        if packed:  # the decoder's additive key bias: -inf at padded prompt slots, 0 elsewhere
            keep[:, :, :length].copy_(decoder.key_bias)
        else:
            keep[:, :length].copy_(decoder.valid)
        cos[:, :, :length].copy_(decoder.cos)
        sin[:, :, :length].copy_(decoder.sin)
        # the packed step's weights and sizes, the same for every step of this generation
        self._packed_args = (
            tuple(
                (l.norm1, l.eps1, f.qkv.linears[0].weight, f.qkv.linears[0].bias, f.o.weight, f.o.bias,
                 l.norm2, l.eps2, f.gate_up.linears[0].weight, f.down.weight)
                for l, f in zip(decoder.layers, decoder.fused)
            ),
            (decoder.norm, decoder.norm_eps, decoder.lm_head),
            (decoder.head_dim, decoder.groups, decoder.scale, kv_heads, packed, decoder.record is not None),
        ) if packed else None

    def _allocate(self, key: tuple) -> None:
        rows, kv_heads, total, head_dim, layers, dtype, device, table_dtype, packed = key
        shape = (rows, kv_heads, total, head_dim)
        self.caches = tuple(
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(layers)
        )
        table = (rows, 1, total, head_dim)
        keep = (torch.zeros((rows * kv_heads, 1, total), dtype=dtype, device=device) if packed
                else torch.zeros((rows, total), dtype=torch.bool, device=device))
        self.tables = (
            keep,
            torch.zeros(table, dtype=table_dtype, device=device),
            torch.zeros(table, dtype=table_dtype, device=device),
        )
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        for buf in (*(t for pair in self.caches for t in pair), *self.tables, self.slot):
            torch._dynamo.mark_static_address(buf)
        self._key = key

    def step(self, decoder: "LeanDecoder", tokens: torch.Tensor) -> torch.Tensor:
        """The next logits ``[R, V]`` after ``tokens [R]`` at ``decoder``'s current slot;
        with the decoder keeping its forward, each layer's outputs go to its record."""
        self.slot.fill_(decoder._t)
        record = decoder.record
        mode = None
        if self._packed_args is not None:
            layers, head, shape = self._packed_args
            out = compiled_packed_fn()(tokens, self.slot, decoder.embed, layers, head, self.caches, self.tables, shape)
        else:
            layers = tuple(
                (l.norm1, l.eps1, l.q, l.k, l.v, l.o, l.norm2, l.eps2, l.gate, l.up, l.down) for l in decoder.layers
            )
            head = (decoder.norm, decoder.norm_eps, decoder.lm_head)
            shape = (decoder.head_dim, decoder.groups, decoder.scale, record is not None)
            mode = compile_mode(tokens.device)
            out = compiled_step_fn(mode)(tokens, self.slot, decoder.embed, layers, head, self.caches, self.tables,
                                         shape)
        logits = out
        if record is not None:  # copied out at once: a CUDA graph's next replay overwrites them
            logits, kept = out
            for index, outputs in enumerate(kept):
                record.put_step(index, outputs)
        # a CUDA graph's output lives in the graph's memory and the next replay overwrites it
        return logits.clone() if mode == "reduce-overhead" else logits


def _packed_kernel(decoder: "LeanDecoder") -> str | None:
    """The packed product ``decoder``'s generation runs on (a CPU in float32), which then
    steps with :func:`packed_step`; None when its weights are not packed."""
    return decoder.fused[0].o.kernel if decoder.fused else None
