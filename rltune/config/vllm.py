"""The vLLM engine's config section (``rollout.vllm``). Imports no torch."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no setting is infinite or NaN


VLLM_RESERVED_ARGS = frozenset({
    "model", "tokenizer", "dtype", "seed", "logprobs_mode", "worker_extension_cls",
    "tensor_parallel_size", "distributed_executor_backend", "trust_remote_code",
})
"""``vllm.LLM`` arguments the vLLM generator sets itself (from ``model``, ``train.seed``, ...)."""


class VLLMConfig(_Section):
    """The vLLM engine of ``rollout.engine: vllm`` (one per generator, on one GPU)."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of the GPU's memory vLLM may take for weights and KV cache; leave room for a
    learner that shares the GPU (``runtime.placement.colocate``)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt plus completion; None: the model's own limit."""
    enforce_eager: bool = False
    """True: no CUDA graphs (quicker start, slower decoding)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one generator's engine spans, its weights split over them (tensor parallel;
    vLLM's multiprocess executor when > 1). For a model whose 16-bit weights do not fit
    one GPU. On Ray, ``runtime.placement.generator.gpus`` must reserve as many."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Further ``vllm.LLM`` keyword arguments, passed as they are (not those in
    ``VLLM_RESERVED_ARGS``, which rltune sets)."""

    @model_validator(mode="after")
    def _not_ours(self) -> "VLLMConfig":
        if clash := sorted(VLLM_RESERVED_ARGS & set(self.engine_args)):
            raise ValueError(f"rollout.vllm.engine_args: {clash} are set by rltune (model.*, train.seed), not here")
        return self


def vllm_keys_set(vllm: VLLMConfig) -> list[str]:
    """The ``rollout.vllm`` keys set away from their defaults, each as ``key=value``."""
    default = VLLMConfig()
    return [f"rollout.vllm.{key}={getattr(vllm, key)}" for key in type(vllm).model_fields
            if getattr(vllm, key) != getattr(default, key)]
