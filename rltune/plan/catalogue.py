"""Model shapes for the planner: from a ``config.json``, a model directory or a
``builtin:`` name, and what follows from a shape (parameter counts, FLOPs and KV-cache
bytes per token). Reads JSON only: no weights, no torch, no transformers.

Parameter counts follow the modules of transformers' Llama, Mistral, Mixtral, Qwen2,
Qwen2-MoE, Qwen3 and Qwen3-MoE implementations exactly (every weight, bias and norm), so
that ``param_count`` equals ``sum(p.numel() for p in model.parameters())``; the catalogue
tests check each public architecture within 1 % of its model card's figure.

FLOP convention (``forward_flops_per_token``): 2 FLOPs per multiply-add, so a matmul
with ``N`` weights costs ``2 N`` per token (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", Table 1), over the weights the token actually multiplies: every linear
layer of the blocks it passes through (its ``experts_per_token`` experts only) and the LM
head, not the input embedding (a lookup), the norms or the biases. Attention adds
``2 x 2 x context x heads x head_dim`` per layer, ``Q K^T`` and ``A V``, as in PaLM's
MFU appendix (Chowdhery et al. 2022, App. B: ``6N + 12 L H Q T`` for forward and
backward, whose forward third is ``2N + 4 L H Q T``). ``context`` is the number of keys
the token attends to; PaLM takes the full sequence ``T``, we take what a causal kernel
computes: ``p`` keys for the token at position ``p``, so a whole sequence of ``T`` tokens
averages ``(T + 1) / 2`` (``forward_flops`` sums it exactly). Softmax, norms and
activations (``O(context)`` or ``O(hidden)`` per token) are left out, as in both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rltune.plan.errors import PlanError
from rltune.plan.spec import ModelSpec

BUILTIN = "builtin:"

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_TYPES = DENSE_TYPES + MOE_TYPES
"""``model_type``s whose decoder-only layout ``ModelSpec`` describes."""


# --- the catalogue ----------------------------------------------------------------------
# Each entry is the architecture's published config.json (the Hugging Face repository
# named beside it), reduced to the keys that shape the parameters. Model-card totals are
# in tests/unit/plan/test_catalogue.py.

def _public(name: str, **shape: Any) -> ModelSpec:
    return ModelSpec(name=name, **shape)


_PUBLIC = (
    # meta-llama/Llama-3.1-8B
    _public("llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
            intermediate=14336, vocab=128256),
    # meta-llama/Llama-3.1-70B
    _public("llama-3.1-70b", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
            intermediate=28672, vocab=128256),
    # Qwen/Qwen2.5-1.5B (tied embeddings)
    _public("qwen2.5-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128,
            intermediate=8960, vocab=151936, tied_embeddings=True, qkv_bias=True),
    # Qwen/Qwen2.5-7B
    _public("qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
            intermediate=18944, vocab=152064, qkv_bias=True),
    # Qwen/Qwen2.5-72B
    _public("qwen2.5-72b", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
            intermediate=29568, vocab=152064, qkv_bias=True),
    # Qwen/Qwen3-8B
    _public("qwen3-8b", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
            intermediate=12288, vocab=151936, qk_norm=True),
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 per token, every layer sparse
    _public("qwen3-30b-a3b", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
            intermediate=6144, vocab=151936, qk_norm=True, experts=128, experts_per_token=8,
            expert_intermediate=768, router_aux_loss_coef=0.001),
    # Qwen/Qwen3-235B-A22B: 128 experts of width 1536, 8 per token, every layer sparse
    _public("qwen3-235b-a22b", hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128,
            intermediate=12288, vocab=151936, qk_norm=True, experts=128, experts_per_token=8,
            expert_intermediate=1536, router_aux_loss_coef=0.001),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336, 2 per token
    _public("mixtral-8x7b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
            intermediate=14336, vocab=32000, experts=8, experts_per_token=2,
            expert_intermediate=14336, router_aux_loss_coef=0.02),
)

TINY_BUILD_ARGS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="qwen2", hidden_size=128, layers=4, heads=4, kv_heads=2),
    "tiny-moe": dict(
        arch="qwen2_moe", hidden_size=128, layers=2, heads=4, kv_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    ),
}
"""``rltune.models.tiny.TINY_SPECS``, restated here because that module imports torch;
``test_catalogue.py`` checks the two are equal and that the specs count the built
models' parameters exactly."""

TINY_VOCAB = 260
"""The tiny models' byte-level tokenizer: 4 special tokens and 256 bytes."""


def tiny_config(arch: str, hidden_size: int, layers: int, heads: int, kv_heads: int,
                **overrides: Any) -> dict[str, Any]:
    """The keys of the ``config.json`` that ``rltune.models.tiny.build_tiny`` writes for
    these arguments, as its ``_qwen2_config`` / ``_qwen2_moe_config`` fill them: MLP
    width 4 x hidden, expert and shared-expert width 2 x hidden, 4 experts, 2 per token,
    every layer sparse, tied embeddings, the tokenizer's 260 ids."""
    config: dict[str, Any] = dict(
        model_type=arch, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=TINY_VOCAB, tie_word_embeddings=True,
    )
    if arch == "qwen2_moe":
        config |= dict(moe_intermediate_size=2 * hidden_size,
                       shared_expert_intermediate_size=2 * hidden_size, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    return config | overrides



# --- reading a config.json --------------------------------------------------------------


def load_model_spec(path: str) -> ModelSpec:
    """The shape of the model at ``path``: ``builtin:NAME`` (a key of ``CATALOGUE``), a
    model directory holding ``config.json``, or a ``config.json`` file. Loads no weights.
    Raises ``PlanError`` (one line, naming the file and key) for an unknown name, a
    missing or unreadable file, a missing key or an architecture the planner does not
    model."""
    if path.startswith(BUILTIN):
        name = path[len(BUILTIN):]
        if name not in CATALOGUE:
            known = ", ".join(BUILTIN + k for k in CATALOGUE)
            raise PlanError(f"unknown model {path!r}: the planner's catalogue has {known}")
        return CATALOGUE[name]
    where = Path(path)
    if where.is_dir():
        file, name = where / "config.json", where.name
        if not file.is_file():
            raise PlanError(f"model directory {where} has no config.json (planning reads only "
                            f"the model's config.json)")
    elif where.is_file():
        file = where
        name = where.parent.name if where.name == "config.json" else where.stem
    else:
        known = ", ".join(BUILTIN + k for k in CATALOGUE)
        raise PlanError(f"model path {path!r} is neither a builtin: name, a directory nor a file; "
                        f"give a local model directory, its config.json, or one of {known}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read model config {file}: {exc}") from None
    if not isinstance(config, dict):
        raise PlanError(f"model config {file} holds a {type(config).__name__}, not a JSON object")
    return spec_from_config(config, source=str(file), name=name or "model")


def _key(config: dict[str, Any], key: str, source: str, default: Any = None) -> Any:
    """``config[key]``, or ``default`` where transformers' config class has one for this
    family (``None``: the key is required)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise PlanError(f"model config {source} has no `{key}`, which the planner needs")
        return default
    return value


def _count(config: dict[str, Any], key: str, source: str, default: int | None = None,
           minimum: int = 1) -> int:
    value = _key(config, key, source, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"model config {source}: `{key}` is {value!r}, expected an integer "
                        f">= {minimum}")
    return value


def _flag(config: dict[str, Any], key: str, source: str) -> bool:
    """``config[key]`` as a JSON boolean (absent or null: false); a string or number is
    refused (``"false"`` is not false)."""
    value = config.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise PlanError(f"model config {source}: `{key}` is {value!r}, expected true or false")
    return value


def _check_type(config: dict[str, Any], source: str) -> str:
    model_type = config.get("model_type")
    if config.get("is_encoder_decoder"):
        raise PlanError(f"model config {source} is an encoder-decoder model (`is_encoder_decoder`); "
                        f"the planner models decoder-only transformers")
    if model_type not in SUPPORTED_TYPES:
        raise PlanError(f"model config {source}: `model_type` {model_type!r} is not an "
                        f"architecture the planner models ({', '.join(SUPPORTED_TYPES)})")
    if config.get("mlp_bias"):
        raise PlanError(f"model config {source}: `mlp_bias: true` (biases in the MLP) is not "
                        f"modelled by the planner")
    return model_type


def _biases(config: dict[str, Any], model_type: str) -> dict[str, bool]:
    """Qwen2 always has q, k, v biases; Qwen2-MoE by ``qkv_bias`` (default true); Llama and
    Qwen3 put one on q, k, v and o with ``attention_bias``; Mistral and Mixtral none."""
    if model_type == "qwen2":
        return dict(qkv_bias=True, o_bias=False)
    if model_type == "qwen2_moe":
        return dict(qkv_bias=bool(config.get("qkv_bias", True)), o_bias=False)
    both = model_type in ("llama", "qwen3", "qwen3_moe") and bool(config.get("attention_bias"))
    return dict(qkv_bias=both, o_bias=both)


def _moe_fields(config: dict[str, Any], model_type: str, layers: int, source: str) -> dict[str, int]:
    """Experts, their width, the shared expert and how many leading layers stay dense.

    A layer is sparse when it is not in ``mlp_only_layers``, ``(layer + 1) %
    decoder_sparse_step == 0`` (Qwen-MoE) and ``layer >= first_k_dense_replace``; the
    spec holds dense layers as a leading block, so any other pattern is refused."""
    if model_type not in MOE_TYPES:
        return {}
    if model_type == "mixtral":
        experts = _count(config, "num_local_experts", source)
        width = _count(config, "intermediate_size", source)
    else:
        experts = _count(config, "num_experts", source)
        width = _count(config, "moe_intermediate_size", source)
    per_token = _count(config, "num_experts_per_tok", source)
    if per_token > experts:
        raise PlanError(f"model config {source}: `num_experts_per_tok` {per_token} exceeds the "
                        f"{experts} experts")
    shared = 0
    if model_type == "qwen2_moe":
        shared = _count(config, "shared_expert_intermediate_size", source, minimum=0)
    step = _count(config, "decoder_sparse_step", source, default=1)
    dense_only = config.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise PlanError(f"model config {source}: `mlp_only_layers` is {dense_only!r}, expected a list of "
                        f"layer indices")
    if any(not 0 <= i < layers for i in dense_only):
        raise PlanError(f"model config {source}: `mlp_only_layers` {dense_only} names layers outside the "
                        f"{layers} layers (0 .. {layers - 1})")
    dense_only = set(dense_only)
    first_dense = _count(config, "first_k_dense_replace", source, default=0, minimum=0)
    dense = [i for i in range(layers)
             if i in dense_only or (i + 1) % step != 0 or i < first_dense]
    if dense != list(range(len(dense))):
        raise PlanError(f"model config {source}: dense layers {dense} (from `mlp_only_layers`, "
                        f"`decoder_sparse_step`) are not the leading ones; the planner models "
                        f"only a leading block of dense layers")
    coef = config.get("router_aux_loss_coef")
    coef = 0.001 if coef is None else coef  # transformers' MoE configs' default
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise PlanError(f"model config {source}: `router_aux_loss_coef` is {coef!r}, expected a number >= 0")
    return dict(experts=experts, experts_per_token=per_token, expert_intermediate=width,
                shared_expert_intermediate=shared, dense_layers=len(dense), router_aux_loss_coef=float(coef))


def spec_from_config(config: dict[str, Any], *, source: str, name: str) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` already parsed; ``source`` names
    it in errors. Keys are read with transformers' defaults for the family where it has one
    that a published config may omit (``num_key_value_heads``: the query heads;
    ``head_dim``: hidden / heads, dense Qwen3's 128; ``tie_word_embeddings``: false)."""
    model_type = _check_type(config, source)
    hidden = _count(config, "hidden_size", source)
    heads = _count(config, "num_attention_heads", source)
    layers = _count(config, "num_hidden_layers", source)
    kv_heads = _count(config, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise PlanError(f"model config {source}: {heads} `num_attention_heads` is not a multiple "
                        f"of {kv_heads} `num_key_value_heads`")
    head_dim_default = 128 if model_type == "qwen3" else hidden // heads  # Qwen3Config's 128
    return ModelSpec(
        name=name, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=_count(config, "head_dim", source, default=head_dim_default),
        intermediate=_count(config, "intermediate_size", source),
        vocab=_count(config, "vocab_size", source),
        tied_embeddings=_flag(config, "tie_word_embeddings", source),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **_biases(config, model_type),
        **_moe_fields(config, model_type, layers, source),
    )


CATALOGUE: dict[str, ModelSpec] = {spec.name: spec for spec in _PUBLIC} | {
    name: spec_from_config(tiny_config(**args), source=f"{BUILTIN}{name}", name=name)
    for name, args in TINY_BUILD_ARGS.items()
}
"""Architectures known by name, as ``builtin:NAME``: public models' shapes (no weights)
and the project's own tiny models (``rltune.models.tiny``)."""


# --- counts -----------------------------------------------------------------------------


def tp_counts(spec: ModelSpec) -> tuple[int, ...]:
    """What tensor parallelism splits evenly (``rltune.parallel.layout``'s check): the
    query and key/value heads, the vocabulary, and the dense MLP width (a dense model's,
    an MoE model's leading dense layers') and the shared expert's
    (``rltune.parallel.layout.tp_widths``); routed experts are replicated over tp."""
    dense = spec.intermediate if not spec.is_moe or spec.dense_layers else 0
    widths = tuple(w for w in (dense, spec.shared_expert_intermediate) if w)
    return (spec.heads, spec.kv_heads, spec.vocab, *widths)


def _attention_weights(spec: ModelSpec) -> int:
    """Weights of q, k, v and o in one layer (matmul parameters)."""
    q = spec.heads * spec.head_dim
    kv = spec.kv_heads * spec.head_dim
    return 2 * spec.hidden * q + 2 * spec.hidden * kv


def _attention_extras(spec: ModelSpec) -> int:
    """Biases and q/k norms of one layer's attention, and the layer's two RMSNorms."""
    qkv = (spec.heads + 2 * spec.kv_heads) * spec.head_dim if spec.qkv_bias else 0
    o = spec.hidden if spec.o_bias else 0
    qk_norm = 2 * spec.head_dim if spec.qk_norm else 0
    return qkv + o + qk_norm + 2 * spec.hidden


def _mlp(spec: ModelSpec, width: int) -> int:
    """A gated MLP (gate, up, down; no biases) of this width."""
    return 3 * spec.hidden * width


def _is_sparse(spec: ModelSpec, layer: int) -> bool:
    return spec.is_moe and layer >= spec.dense_layers


def _shared_expert(spec: ModelSpec) -> int:
    """Qwen2-MoE's shared expert and its sigmoid gate (a ``hidden -> 1`` linear)."""
    if not spec.shared_expert_intermediate:
        return 0
    return _mlp(spec, spec.shared_expert_intermediate) + spec.hidden


def _mlp_of(spec: ModelSpec, sparse: bool, experts: int) -> int:
    """A dense or MoE layer's MLP matmul weights with ``experts`` routed experts counted (a
    dense layer ignores ``experts``); the router is ``hidden x experts``."""
    if not sparse:
        return _mlp(spec, spec.intermediate)
    router = spec.hidden * spec.experts
    return router + experts * _mlp(spec, spec.expert_intermediate) + _shared_expert(spec)


def _check_layer(spec: ModelSpec, layer: int) -> None:
    if not 0 <= layer < spec.layers:
        raise PlanError(f"layer {layer} of {spec.name}: it has layers 0 to {spec.layers - 1}")


def layer_params(spec: ModelSpec, layer: int) -> int:
    """Parameters of transformer block ``layer`` (0-based): attention with its biases and
    norms, the two RMSNorms, and the MLP (every expert of an MoE layer)."""
    _check_layer(spec, layer)
    return block_params(spec, sparse=_is_sparse(spec, layer))


def block_params(spec: ModelSpec, *, sparse: bool) -> int:
    """:func:`layer_params` of any dense (``sparse`` False) or MoE layer: every layer of a
    kind has the same parameters, so sums over layers are counts times this."""
    return _attention_weights(spec) + _attention_extras(spec) + _mlp_of(spec, sparse, spec.experts)


def sparse_in(spec: ModelSpec, lo: int, hi: int) -> int:
    """How many of layers ``lo .. hi - 1`` are MoE layers (the dense ones of an MoE model
    are a leading block of ``dense_layers``)."""
    if not spec.is_moe:
        return 0
    return max(0, hi - max(lo, spec.dense_layers))


def embedding_params(spec: ModelSpec) -> int:
    """Input embedding and LM head, ``vocab x hidden`` each, once when tied."""
    return spec.vocab * spec.hidden * (1 if spec.tied_embeddings else 2)


def param_count(spec: ModelSpec) -> int:
    """Every parameter: embeddings, the blocks, the final RMSNorm (a tied matrix once)."""
    sparse = sparse_in(spec, 0, spec.layers)
    blocks = (spec.layers - sparse) * block_params(spec, sparse=False) + sparse * block_params(spec, sparse=True)
    return embedding_params(spec) + blocks + spec.hidden


def lora_params(spec: ModelSpec, rank: int) -> int:
    """Adapter parameters of ``lora.target_modules: all-linear`` at rank r: ``r (in + out)``
    per adapted linear (A is ``r x in``, B ``out x r``; Hu et al. 2021). Adapted: q, k, v,
    o and the gated MLP (gate, up, down) of every block, dense or shared-expert; not the
    head (all-linear excludes it), not the routed experts (fused 3-D parameters in
    transformers 5, not ``nn.Linear``) nor the router."""
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    attention = rank * ((h + q) + 2 * (h + kv) + (q + h))
    sparse = sparse_in(spec, 0, spec.layers)
    total = spec.layers * attention
    for count, width in ((spec.layers - sparse, spec.intermediate), (sparse, spec.shared_expert_intermediate)):
        total += count * (3 * rank * (h + width) if width else 0)
    return total


def expert_params(spec: ModelSpec) -> int:
    """All routed experts of the model (not the routers, not the shared expert); 0 for a
    dense model."""
    return sparse_in(spec, 0, spec.layers) * spec.experts * _mlp(spec, spec.expert_intermediate)


def active_param_count(spec: ModelSpec) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to, i.e.
    ``param_count - sparse_layers x (experts - experts_per_token) x expert``; the model
    cards' "activated" figure (embeddings included)."""
    if not spec.is_moe:
        return param_count(spec)
    unused = spec.experts - spec.experts_per_token
    return param_count(spec) - expert_params(spec) // spec.experts * unused


def matmul_params_per_token(spec: ModelSpec) -> int:
    """Weights one token multiplies: the attention and MLP linears of every block (its
    ``experts_per_token`` experts, the router and any shared expert) and the LM head;
    not the input embedding, norms or biases."""
    sparse = sparse_in(spec, 0, spec.layers)
    mlps = (spec.layers - sparse) * _mlp_of(spec, False, 0) + sparse * _mlp_of(spec, True, spec.experts_per_token)
    return spec.layers * _attention_weights(spec) + mlps + spec.vocab * spec.hidden


def attention_flops_per_key(spec: ModelSpec) -> float:
    """FLOPs one query token spends per key it attends to, over all layers:
    ``2 x 2 x layers x heads x head_dim`` (``Q K^T`` and ``A V``, PaLM App. B)."""
    return 4.0 * spec.layers * spec.heads * spec.head_dim


def forward_flops_per_token(spec: ModelSpec, context: float) -> float:
    """Forward FLOPs of one token that attends to ``context`` keys (itself included):
    ``2 x matmul_params_per_token + 4 x layers x heads x head_dim x context`` (module
    docstring: Kaplan et al. 2020 Table 1, PaLM App. B). For the mean over a causal
    sequence of ``T`` tokens pass ``(T + 1) / 2``; a decode step at position ``p``
    passes ``p``. Backward is twice this (Kaplan et al. 2020, section 2.1)."""
    if context < 0:
        raise PlanError(f"forward_flops_per_token: context {context} is negative")
    return 2.0 * matmul_params_per_token(spec) + attention_flops_per_key(spec) * context


def forward_flops(spec: ModelSpec, tokens: int, past: int = 0) -> float:
    """Forward FLOPs of ``tokens`` new tokens after ``past`` cached ones (a prefill, or a
    training row with ``past = 0``): token ``past + j`` attends to ``past + j`` keys, so the
    contexts sum to ``tokens x past + tokens (tokens + 1) / 2``."""
    if tokens < 0 or past < 0:
        raise PlanError(f"forward_flops: tokens {tokens} and past {past} must be >= 0")
    keys = tokens * past + tokens * (tokens + 1) / 2
    return 2.0 * matmul_params_per_token(spec) * tokens + attention_flops_per_key(spec) * keys


def kv_bytes_per_token(spec: ModelSpec, bytes_per_value: float) -> float:
    """KV-cache bytes one token occupies: ``2 (K and V) x layers x kv_heads x head_dim x
    bytes_per_value``."""
    return 2.0 * spec.layers * spec.kv_heads * spec.head_dim * bytes_per_value
