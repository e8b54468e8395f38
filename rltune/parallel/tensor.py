"""Tensor parallelism over the ``tp`` dim of the learner group's mesh, and log-probs and
entropy on vocabulary-sharded logits.

:func:`apply_tensor_parallel` splits a Hugging Face causal LM of the Llama family (Qwen2,
Qwen3, Llama, Mistral) or of its MoE relatives (Mixtral, Qwen2-MoE, Qwen3-MoE) over ``tp``
ranks that see the same rows, with ``torch.distributed.tensor.parallel`` plans (Megatron's
layout, Shoeybi et al. 2019):

* attention: ``q/k/v_proj`` column-parallel (each rank computes ``heads / tp`` query heads
  and ``kv_heads / tp`` KV heads; HF's attention reshapes with ``-1`` heads, so it runs on
  the local heads unchanged), ``o_proj`` row-parallel (one all-reduce of ``[B, T, H]``);
* MLP: ``gate/up_proj`` column-parallel, ``down_proj`` row-parallel (one all-reduce);
* embeddings: vocabulary-sharded (row-parallel ``nn.Embedding``: a rank looks up the ids
  it holds, one all-reduce); ``lm_head`` column-parallel whose output stays sharded over
  the vocabulary, a DTensor ``Shard(-1)``: the ``[B, T, V]`` logits are never gathered,
  :func:`rltune.models.vocab_parallel.vocab_parallel_token_stats` reads log-probs and entropy off the shards. Tied
  embeddings (``lm_head.weight is embed_tokens.weight``) stay one parameter: both are
  ``[V, H]`` sharded on the vocabulary, the same ``Shard(0)``;
* MoE blocks: the shared expert (Qwen2-MoE) is tensor-parallel like a dense MLP; the
  router and the **routed experts are replicated over tp**: every tp rank computes them
  on the same tokens. Experts are sharded by the ``ep`` dim (``rltune.parallel.experts``),
  which gives their memory back without splitting each expert's already small
  intermediate dim a second time (that would add an all-reduce per MoE layer on top of
  the all-to-all, and Mixtral-style fused ``gate_up_proj`` would need its halves
  interleaved per rank); the cost is ``tp``-fold expert compute, so MoE models should
  spend their ranks on ``ep`` before ``tp``;
* norms: with ``sequence_parallel`` every RMSNorm (and the residual stream between the
  tensor-parallel regions) is sharded over the sequence dim: the all-reduces become an
  all-gather before and a reduce-scatter after each region (the same bytes), and the
  norms' activations take ``1/tp`` of the memory (Korthikanti et al. 2022). Without it
  the norms compute on the full, replicated activations. Their weights are replicated
  DTensors either way, so every parameter of a tensor-parallel model is a DTensor on the
  tp mesh except the MoE router and experts (plain tensors, identical on every tp rank,
  for the ep wrapping that follows).

Gradients need no extra step: every tp rank computes the same loss, and the DTensor
layouts put the right collective in the backward (an all-reduce where a replicated
activation enters a column-parallel layer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rltune.parallel.layout import TP_MODEL_TYPES, tp_widths

SUPPORTED = TP_MODEL_TYPES
"""``config.model_type`` values :func:`apply_tensor_parallel` has a plan for."""


class TensorParallelError(ValueError):
    """A model that cannot be split over the tp ranks; the message says what and why."""


class _Replicated(ParallelStyle):
    """A module whose parameters are replicated over tp and whose input arrives with
    ``input_layout`` (a plain tensor in, a plain tensor out).

    Its weights become ``Replicate`` DTensors, so the clip and the checkpoint see one
    kind of parameter, and its computation runs on DTensors: with ``Replicate`` input
    (a norm on the full activations) every rank's weight gradient is already the whole
    one; with ``Shard`` input (Qwen3's per-head q/k norms on the local heads) the weight
    gradient is partial and DTensor sums it over tp in the backward.
    """

    def __init__(self, input_layout: Any) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(
                    DTensor.from_local(param, mesh, [Replicate()], run_check=False),
                    requires_grad=param.requires_grad))

        def to_dtensor(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                         for x in inputs)

        def to_local(mod: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, replicate, to_dtensor, to_local)


class _VocabEmbedding(ParallelStyle):
    """``nn.Embedding`` split on the vocabulary (Megatron's vocab-parallel embedding):
    each rank looks up the ids in its slice from its local ``[V/tp, H]`` rows, 0 for the
    others, and the partial outputs are summed (an all-reduce, or a reduce-scatter to
    sequence shards ``output_layout=Shard(1)``).

    The lookup runs on the local rows, not through DTensor's embedding: DTensor computes
    a row-sharded embedding's weight gradient as a whole ``[V, H]`` matrix on every rank
    and reduce-scatters it, which costs a vocabulary-sized buffer and collective per
    backward; here each rank's gradient is its own rows', with no collective. The
    ``padding_idx`` row (no gradient) is the global one, on the rank that holds it."""

    def __init__(self, output_layout: Any, use_local_output: bool) -> None:
        super().__init__()
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = module.weight
        module.register_parameter("weight", nn.Parameter(
            distribute_tensor(weight.detach(), device_mesh, [Shard(0)], src_data_rank=0),
            requires_grad=weight.requires_grad))
        layout, local_output = self.output_layout, self.use_local_output

        def forward(ids: torch.Tensor) -> torch.Tensor:
            rows = module.weight.to_local()
            start = device_mesh.get_local_rank() * rows.shape[0]
            inside = (ids >= start) & (ids < start + rows.shape[0])
            pad = module.padding_idx
            pad = pad - start if pad is not None and start <= pad < start + rows.shape[0] else None
            out = nn.functional.embedding(torch.where(inside, ids - start, 0), rows, padding_idx=pad)
            out = out * inside.unsqueeze(-1).to(out.dtype)
            out = DTensor.from_local(out, device_mesh, [Partial()], run_check=False).redistribute(
                device_mesh, [layout])
            return out.to_local() if local_output else out

        module.forward = forward
        return module


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Split ``model`` in place over the 1-D ``tp_mesh`` (see the module docstring).

    Every rank of ``tp_mesh`` must hold the same weights before (the column- and
    row-parallel weights are scattered from the mesh's first rank). The model's forward
    then returns its logits as a DTensor sharded on the vocabulary (``Shard(-1)`` on
    ``tp_mesh``); :func:`rltune.models.logprobs.completion_logprobs` reads them with
    :func:`rltune.models.vocab_parallel.vocab_parallel_token_stats`. Raises :class:`TensorParallelError` for an
    architecture without a plan, or head, KV-head, intermediate or vocabulary sizes that
    ``tp`` does not divide.
    """
    if tp_mesh.ndim != 1:
        raise TensorParallelError(f"apply_tensor_parallel needs the 1-D tp mesh, got a {tp_mesh.ndim}-D mesh "
                                  f"{tp_mesh.mesh_dim_names}: pass mesh['tp']")
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise TensorParallelError(
            f"tensor parallelism has no plan for {type(model).__name__} (model_type {model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED)}; set train.parallel.tp: 1 for this model")
    _check_divisible(config, tp_mesh.size(), model_type)
    # a pipeline stage (rltune.parallel.pipeline) has None for the parts it does not own
    embed, head = model.model.embed_tokens, getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    for layer in model.model.layers:
        if layer is not None:
            _parallelize_layer(layer, tp_mesh, sequence_parallel)
    _parallelize_ends(model, tp_mesh, sequence_parallel)
    if tied:  # each style registered a new parameter: make them one again
        model.lm_head.weight = model.model.embed_tokens.weight


def _check_divisible(config: Any, tp: int, model_type: str) -> None:
    """Every size that tp splits must be a multiple of it: heads (a head is never split),
    KV heads (each rank keeps the KV heads of its query heads), the MLP widths and the
    vocabulary (even shards, so a rank's vocabulary offset is ``rank * V / tp``)."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "vocab_size": config.vocab_size,
    }
    sizes |= tp_widths(config)
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        raise TensorParallelError(
            f"train.parallel.tp={tp} does not divide the model's {bad} ({model_type}); "
            f"choose a tp that divides {sorted(sizes.values())}")


def _parallelize_layer(layer: nn.Module, mesh: DeviceMesh, sp: bool) -> None:
    """One decoder layer: norms, attention, then its MLP or MoE block."""
    act = Shard(1) if sp else Replicate()  # the residual stream between regions
    norm = SequenceParallel() if sp else _Replicated(Replicate())
    plan: dict[str, ParallelStyle] = {
        "input_layernorm": norm,
        "post_attention_layernorm": norm,
        # HF calls the attention with keyword arguments, the MLP with one positional
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": act},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=act, use_local_output=not sp),
    }
    attn = layer.self_attn
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each local head, [B, T, heads, D]
        plan["self_attn.q_norm"] = _Replicated(Shard(2))
        plan["self_attn.k_norm"] = _Replicated(Shard(2))
    plan.update(_mlp_plan(layer.mlp, act, sp))
    parallelize_module(layer, mesh, plan)


def _mlp_plan(mlp: nn.Module, act: Any, sp: bool) -> dict[str, ParallelStyle]:
    """A dense MLP (``gate/up/down_proj``) split like Megatron's; an MoE block computed
    on the gathered tokens with its shared expert split and its experts replicated."""
    if hasattr(mlp, "experts"):
        plan: dict[str, ParallelStyle] = {"mlp": PrepareModuleInputOutput(
            input_layouts=(act,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(act,), use_local_output=not sp)}
        if getattr(mlp, "shared_expert", None) is not None:
            plan.update({
                "mlp.shared_expert.gate_proj": ColwiseParallel(),
                "mlp.shared_expert.up_proj": ColwiseParallel(),
                "mlp.shared_expert.down_proj": RowwiseParallel(output_layouts=Replicate()),
            })
        return plan
    return {
        "mlp": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=act, use_local_output=not sp),
    }


def _parallelize_ends(model: nn.Module, mesh: DeviceMesh, sp: bool) -> None:
    """Embeddings sharded on the vocabulary, the final norm, and the head whose logits
    stay sharded on the vocabulary (a ``Shard(-1)`` DTensor)."""
    act = Shard(1) if sp else Replicate()
    plan = {
        "model.embed_tokens": _VocabEmbedding(act, use_local_output=not sp),
        "model.norm": SequenceParallel() if sp else _Replicated(Replicate()),
        "lm_head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, {name: style for name, style in plan.items()
                                     if _present(model, name)})


def _present(model: nn.Module, name: str) -> bool:
    module: Any = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


__all__ = [
    "SUPPORTED",
    "TensorParallelError",
    "apply_tensor_parallel",
]
