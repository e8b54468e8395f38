"""The ``train`` config section: the optimizer, batching, precision and memory tools, and
the learner group's layout (``train.parallel``). Imports no torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rltune.config.parallel import ParallelConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainConfig(_Section):
    steps: int = Field(100, ge=0)
    prompts_per_step: int = Field(16, ge=1)
    """Prompts drawn per step; online algorithms learn on ``prompts_per_step * group_size``
    samples, SFT on ``prompts_per_step`` examples."""
    lr: float = Field(1e-5, ge=0, allow_inf_nan=False)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """``schedule: cosine``: the lr it ends at, as a share of ``lr``; refused with ``constant``."""
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(8192, ge=1)
    """Token budget (rows x padded length) of one micro-batch; gradients accumulate."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """Completion tokens whose logits exist at once when computing log-probs and entropy
    (learner, reference, preference reference pass): the LM head runs on chunks of this
    many tokens, recomputed chunk by chunk in the backward, so the float32 ``[B, C, V]``
    logits are never whole (``rltune/models/chunked.py``). 0 computes the full logits."""
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    """``bf16``/``fp16``: forward and backward under autocast, master weights fp32;
    ``fp16`` with dynamic loss scaling. ``fp8``: torchao's float8 training of the linear
    layers (GPUs with fp8 support; the ``fp8`` extra). See ``docs/performance.md``."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward instead of keeping them: ``full`` every
    transformer block, ``selective`` every ``checkpoint_every``-th block
    (``rltune/learner/memory.py``, ``docs/performance.md``)."""
    checkpoint_every: int | None = Field(None, ge=1)
    """With ``activation_checkpointing: selective``: checkpoint the k-th, 2k-th, ... block
    (None: k = 2); refused with the other modes."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """Keep state on the host: ``optimizer`` (AdamW's moments and step, for a learner
    holding the whole model on a GPU: one process or DDP), ``params`` (FSDP2's CPU offload
    of sharded parameters, gradients and optimizer state: ``learner_strategy: fsdp2`` or
    ``train.parallel`` with ``dp_shard > 1``, on learners with a GPU)."""
    reuse_rollout_mb: int = Field(1024, ge=0)
    """Where the generator decodes on the learner's own module (a local run,
    ``rollout.engine: hf``, ``runtime.max_staleness: 0``), it keeps each token's
    projection outputs, up to this many MB, and the learner's training forward takes
    them instead of repeating the products (``rltune/models/replay.py``): the same
    log-probs and gradients to float32 rounding, a forward without its matrix products.
    Kept until the step's optimizer step; a generation that would pass the budget keeps
    none. Used only where it gives those log-probs: float32 weights (``model.dtype``)
    with ``precision`` and ``rollout.precision`` fp32, no activation checkpointing, no
    ``train.compile``, and a Qwen2/Llama/Mistral model without LoRA (the lean forward's);
    elsewhere nothing is kept, and ``learn/replayed_frac`` is not logged. 0 turns it off."""
    compile: bool = False
    """``torch.compile`` the learner's training forward and backward, one transformer block
    at a time (``rltune/learner/compiled.py``); with one process, DDP or FSDP2, not with
    tp, pp or ep > 1. Off by default: on CPU it costs tens of seconds of compilation per
    run for no faster step (``docs/performance.md``)."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """Stop with an error after this many consecutive steps with a non-finite gradient."""
    max_reward_error_steps: int = Field(3, ge=0)
    """Stop with an error after this many consecutive steps on which the reward failed on
    every sample (each such step learns nothing and is warned about); 0 never stops."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds Python, numpy (which takes 0 to 2**32 - 1) and torch."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the learner (and of the generator when it runs in the
    learner's thread); None leaves torch's default, except in a local run with rollouts
    ahead of the learner, where None is the threads ``rollout.threads`` leaves. On Ray it
    sets the driver's threads only (a note at start says so): each actor runs as many as
    it reserves CPUs (``runtime.placement``)."""
    parallel: ParallelConfig = ParallelConfig()
    """The learner group's layout (``rltune/config/parallel.py``)."""

    @model_validator(mode="after")
    def _check_memory(self) -> "TrainConfig":
        for problem in memory_problems(self):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_compile(self) -> "TrainConfig":
        layout = self.parallel
        if self.compile and (others := [f"{k}={getattr(layout, k)}" for k in ("tp", "pp", "ep")
                                        if getattr(layout, k) > 1]):
            raise ValueError(
                f"train.compile compiles whole transformer blocks on plain tensors; with train.parallel "
                f"{', '.join(others)} the blocks hold DTensor shards or pipeline stages, which it does not "
                "compile: set train.compile: false, or a data-parallel layout (tp = pp = ep = 1)"
            )
        return self


def memory_problems(train: TrainConfig) -> list[str]:
    """``train`` keys of activation checkpointing and offload that could not take effect."""
    problems = []
    if train.checkpoint_every is not None and train.activation_checkpointing != "selective":
        problems.append(f"train.checkpoint_every is for activation_checkpointing: selective; it is "
                        f"{train.activation_checkpointing!r}: remove checkpoint_every or use selective")
    if train.offload == "optimizer" and train.precision == "fp16":
        problems.append("train.offload: optimizer with precision fp16: the loss scaler unscales the optimizer's "
                        "gradients, which the host copy receives only inside its step; use bf16, or offload: none")
    return problems


def offload_problems(train: TrainConfig, *, mode: str, device: str, learners: int, learner_strategy: str,
                     learner_gpus: float) -> list[str]:
    """``train.offload: params`` without a learner group that shards parameters on GPUs
    (Ray learners without a GPU hold their shards in host memory already); ``optimizer``
    without a learner that holds the whole model on a GPU (``device``: the local runtime's
    ``runtime.device``)."""
    if train.offload == "optimizer":
        return _optimizer_offload_problems(train, mode=mode, device=device, learner_strategy=learner_strategy,
                                           learner_gpus=learner_gpus)
    if train.offload != "params":
        return []
    layout = train.parallel
    if layout.model_fields_set:
        shards = layout.dp_shard == "auto" or layout.dp_shard > 1
        others = [k for k in ("tp", "pp", "ep") if getattr(layout, k) > 1]
        if others or not shards:
            return [f"train.offload: params (FSDP2's CPU offload) needs a data-parallel layout: train.parallel "
                    f"dp_shard > 1 (or auto) and tp = pp = ep = 1; this one sets {sorted(layout.model_fields_set)}"]
        sharded = True
    else:
        sharded = learner_strategy == "fsdp2"
    if mode != "ray" or learners < 2 or not sharded:
        has = f"train.parallel dp_shard={layout.dp_shard}" if layout.model_fields_set else \
            f"learner_strategy {learner_strategy!r}"
        return ["train.offload: params is FSDP2's CPU offload of parameters sharded over a learner group: it needs "
                "runtime.mode: ray with runtime.placement.learners > 1, sharded by train.parallel dp_shard > 1 "
                f"(or learner_strategy: fsdp2); this run has mode {mode!r}, {learners} learner(s), {has}"]
    if learner_gpus <= 0:
        return ["train.offload: params moves FSDP2's sharded parameters, gradients and optimizer state from the "
                "learners' GPUs to host memory, but the learners reserve no GPU (runtime.placement.learner.gpus: 0), "
                "so they train on the CPU, where the shards are in host memory already; set "
                "runtime.placement.learner.gpus > 0, or set train.offload: none"]
    return []


def _optimizer_offload_problems(train: TrainConfig, *, mode: str, device: str, learner_strategy: str,
                                learner_gpus: float) -> list[str]:
    """Where ``train.offload: optimizer`` (AdamW's state in host memory for a learner whose
    whole model sits on a GPU) could not take effect, told before any model loads: a local
    run set to the CPU (``runtime.device: cpu``) and a Ray learner without a GPU train on
    the CPU, where the state is in host memory already; FSDP2 and ``train.parallel``
    layouts shard the parameters. A local run on ``auto`` learns where it runs whether a
    GPU is there; the local runtime refuses it then, before the model loads."""
    fix = "or set train.offload: none"
    if mode != "ray":
        if device != "cpu":
            return []
        return ["train.offload: optimizer moves AdamW's state from a GPU learner to host memory, but runtime.device: "
                "cpu trains on the CPU, where it is in host memory already (nothing to offload); use a GPU "
                f"(runtime.device: auto or cuda), {fix}"]
    if learner_gpus <= 0:
        return ["train.offload: optimizer moves AdamW's state from a GPU learner to host memory, but the learners "
                "reserve no GPU (runtime.placement.learner.gpus: 0), so they train on the CPU, where it is in host "
                f"memory already; set runtime.placement.learner.gpus > 0, {fix}"]
    if learner_strategy == "fsdp2" or train.parallel.model_fields_set:
        return ["train.offload: optimizer is for a learner that holds the whole model (one process or DDP); "
                "with runtime.placement.learner_strategy: fsdp2 or a train.parallel layout the parameters are "
                "sharded: use train.offload: params"]
    return []
