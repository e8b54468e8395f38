"""The experiment config: one frozen pydantic model per section, unknown keys rejected.

Every field has its default here and nowhere else. Imports no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: str = "builtin:tiny"
    """A local HF model directory, or ``builtin:tiny`` (a small Qwen2 built on the spot)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype on load. Mixed precision is ``train.precision``."""
    trust_remote_code: bool = False
    """Run model code shipped inside the model directory. Off unless you trust it."""
    router_aux_loss_coef: float | None = None
    """MoE models: weight of the router load-balancing loss; None uses the model config's."""


class AlgoConfig(_Section):
    name: Literal["grpo", "sft"] = "grpo"
    group_size: int = Field(8, ge=1)
    """Samples drawn per prompt; the group is the baseline for GRPO advantages."""
    adv_scale: Literal["std", "none"] = "std"
    """GRPO divides by the group's reward std; ``none`` is Dr.GRPO."""
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL-to-reference term in the loss; 0 loads no reference model."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"


class DataConfig(_Section):
    train: str = "builtin:arith/train"
    """jsonl / parquet file, a local HF ``datasets`` directory, or ``builtin:TASK/SPLIT``."""
    eval: str | None = None
    prompt_field: str = "prompt"
    """Field with the prompt: a string, or a list of ``{role, content}`` messages."""
    completion_field: str = "completion"
    """SFT only: the field with the target completion."""
    id_field: str | None = None
    """Field used as the prompt id; None numbers rows ``FILE:ROW``."""
    system_prompt: str | None = None
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one."""
    max_prompt_tokens: int = Field(512, ge=1)
    on_bad_row: Literal["error", "skip"] = "error"
    """A row with a missing field, an empty prompt or a too-long prompt: stop with an
    error naming file and row, or skip it and count it."""
    shuffle: bool = True


class RolloutConfig(_Section):
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: tuple[str, ...] = ()


class RewardFnConfig(_Section):
    fn: str
    """``module:function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    name: str | None = None
    """Name in metrics and samples; defaults to the function's name."""
    kwargs: dict[str, object] = Field(default_factory=dict)
    """Extra keyword arguments passed on every call."""


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
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward and backward under bf16 autocast; master weights stay fp32."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """Stop with an error after this many consecutive steps with a non-finite gradient."""
    seed: int = 0
    threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""


class LogConfig(_Section):
    dir: str = "runs"
    console: bool = True
    samples_per_step: int | None = None
    """Rollouts written to samples.jsonl per step; None writes all."""


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)
    """Save every N steps; 0 saves only at the end."""
    keep: int = Field(2, ge=1)
    resume: str = "never"
    """``never``, ``auto`` (newest complete checkpoint of this run, if any), or a path."""
    final: bool = True
    """Also write the final model as an HF directory (``RUN/final``)."""


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Evaluate every N steps; 0 only before and after training (when ``data.eval`` is set)."""
    max_prompts: int | None = None
    batch_size: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0)
    """0 is greedy."""
    max_new_tokens: int | None = None
    """None uses ``rollout.max_new_tokens``."""


class RuntimeConfig(_Section):
    mode: Literal["local"] = "local"


class Config(_Section):
    name: str = "run"
    model: ModelConfig = ModelConfig()
    algo: AlgoConfig = AlgoConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: tuple[RewardFnConfig, ...] = ()
    train: TrainConfig = TrainConfig()
    log: LogConfig = LogConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.algo.name == "grpo" and not self.reward:
            raise ValueError("algo.name=grpo needs at least one entry in `reward`")
        if self.algo.name == "grpo" and self.algo.group_size < 2:
            raise ValueError("algo.group_size must be >= 2 for grpo (the group is the baseline)")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name {self.name!r} must be a plain directory name")
        return self
