"""The ``train`` config section: the optimizer, batching, precision and memory tools, and
the learner group's layout (``train.parallel``). Imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rltune.config.parallel import ParallelConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainConfig(_Section):
    steps: int = Field(100, ge=0)
    prompts_per_step: int = Field(16, ge=1)
    """Prompts drawn per step; online algorithms learn on ``prompts_per_step * group_size``
    samples, SFT on ``prompts_per_step`` examples."""
    lr: float = Field(1e-5, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(8192, ge=1)
    """Token budget (rows x padded length) of one micro-batch; gradients accumulate."""
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    """``bf16``/``fp16``: forward and backward under autocast, master weights fp32;
    ``fp16`` with dynamic loss scaling. ``fp8``: torchao's float8 training of the linear
    layers (GPUs with fp8 support; the ``fp8`` extra). See ``docs/performance.md``."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward instead of keeping them: ``full`` every
    transformer block, ``selective`` a subset (``docs/performance.md``)."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """Keep state on the host: ``optimizer`` (AdamW's moments), ``params`` (FSDP2's
    CPU offload of parameters, gradients and optimizer state)."""
    compile: bool = False
    """``torch.compile`` the learner's forward and backward."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """Stop with an error after this many consecutive steps with a non-finite gradient."""
    max_reward_error_steps: int = Field(3, ge=0)
    """Stop with an error after this many consecutive steps on which the reward failed on
    every sample (each such step learns nothing and is warned about); 0 never stops."""
    seed: int = 0
    threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    parallel: ParallelConfig = ParallelConfig()
    """The learner group's layout (``rltune/config/parallel.py``)."""
