"""The dense Llama-family layout (Qwen2, Llama, Mistral) read straight from a model's
parameters: which models have it (:func:`supports_fastpath`), one decoder layer's tensors
(:class:`LayerTensors`), and the RMSNorm and rotary arithmetic of the HF forward.

Two forwards run on it without calling the model's modules: the generator's incremental
decoder (:class:`~rltune.rollout.fastpath.LeanDecoder`) and the learner's training forward
(:mod:`rltune.models.lean_forward`). :func:`supports_fastpath` admits a model only when
every feature of its config is one they implement; anything else (rope scaling, sliding
windows, other activations, adapters that replace the projection modules, registered
hooks) goes through the transformers forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaForCausalLM, MistralForCausalLM, PreTrainedModel, Qwen2ForCausalLM

_CLASSES = (Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM)
_DTYPES = (torch.float32, torch.bfloat16)
_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def supports_fastpath(model: nn.Module) -> bool:
    """Whether the lean forwards (the generator's :class:`~rltune.rollout.fastpath.LeanDecoder`,
    the learner's :mod:`rltune.models.lean_forward`) compute what ``model``'s forward does.

    True only for an (unwrapped) Qwen2 / Llama / Mistral causal LM in float32 or bfloat16
    with SiLU MLPs, default rope, full attention in every layer (no sliding window), no MLP
    bias, ``pretraining_tp`` 1, and plain ``nn.Linear`` projections (an adapter that swaps
    them, e.g. LoRA, is not seen by the lean path). Hooks are checked per call, see
    :func:`has_hooks`.
    """
    if not isinstance(model, _CLASSES):
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None) or ()
    return (
        config.hidden_act == "silu"
        and rope.get("rope_type") == "default"
        and getattr(config, "sliding_window", None) is None
        and all(kind == "full_attention" for kind in layer_types)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "pretraining_tp", 1) == 1
        and model.get_input_embeddings().weight.dtype in _DTYPES
        and _plain_modules(model)
    )


def has_hooks(model: nn.Module) -> bool:
    """Whether any forward hook (global or on a submodule of ``model``) is registered:
    the lean path calls no module, so it would skip them."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _plain_modules(model: PreTrainedModel) -> bool:
    """Every projection a plain ``nn.Linear``, embeddings a plain ``nn.Embedding``, and
    the attention bias as the config states it."""
    inner = model.model
    if type(inner.embed_tokens) is not nn.Embedding or type(model.lm_head) is not nn.Linear:
        return False
    if model.lm_head.bias is not None:
        return False
    embed = inner.embed_tokens  # a lookup and nothing else (the padding row is honoured)
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return False
    # Qwen2 always has q/k/v bias and no o bias; Llama and Mistral follow `attention_bias`.
    qkv_bias = isinstance(model, Qwen2ForCausalLM) or bool(getattr(model.config, "attention_bias", False))
    o_bias = not isinstance(model, Qwen2ForCausalLM) and qkv_bias
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, n) for n in _ATTN_LINEARS] + [getattr(mlp, n) for n in _MLP_LINEARS]
        if any(type(lin) is not nn.Linear for lin in linears):
            return False
        biases = [lin.bias is not None for lin in linears]
        if biases != [qkv_bias] * 3 + [o_bias] + [False] * 3:
            return False
    return True


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's parameter tensors (the model's own, not copies)."""

    norm1: torch.Tensor
    eps1: float
    q: tuple[torch.Tensor, torch.Tensor | None]
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    norm2: torch.Tensor
    eps2: float
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def layer_tensors(layer: nn.Module) -> LayerTensors:
    """``layer``'s parameter tensors, read when called (an optimizer step in place shows)."""
    attn, mlp = layer.self_attn, layer.mlp
    return LayerTensors(
        norm1=layer.input_layernorm.weight, eps1=layer.input_layernorm.variance_epsilon,
        q=(attn.q_proj.weight, attn.q_proj.bias), k=(attn.k_proj.weight, attn.k_proj.bias),
        v=(attn.v_proj.weight, attn.v_proj.bias), o=(attn.o_proj.weight, attn.o_proj.bias),
        norm2=layer.post_attention_layernorm.weight, eps2=layer.post_attention_layernorm.variance_epsilon,
        gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x²) + eps)``, the mean taken in float32 as HF's RMSNorm does."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form: ``x cos + [-x₂, x₁] sin``. ``x [R, heads, T, D]``,
    ``cos, sin [R, 1, T, D]``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
