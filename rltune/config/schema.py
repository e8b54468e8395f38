"""The experiment config: one frozen pydantic model per section, unknown keys rejected.

Every field has its default here and nowhere else. Imports no torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rltune.config.parallel import MoeConfig, moe_problems
from rltune.config.runtime import PlacementConfig, RoleResources, RuntimeConfig  # noqa: F401  (re-exported)
from rltune.config.train import TrainConfig, offload_problems
from rltune.config.vllm import VLLM_RESERVED_ARGS, VLLMConfig  # noqa: F401  (re-exported)
from rltune.metrics.keys import ENV_REWARD, OVERLONG_REWARD, reward_name_problem


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no setting is infinite or NaN


class LoraConfig(_Section):
    """LoRA adapters (Hu et al. 2021): each targeted weight ``W`` stays frozen and the
    model learns ``W + (alpha / r) * B A`` with ``B`` zero at the start, so training
    begins exactly at the base model. Only the adapters (and ``modules_to_save``) train."""

    r: int = Field(8, ge=1)
    """Rank of each update ``B A``; at most the largest ``min(out, in)`` of the adapted
    layers (the hidden size, for an LM), checked when the adapters are built."""
    alpha: float = Field(16.0, gt=0)
    """The update is scaled by ``alpha / r``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training; 0 keeps the adapted forward deterministic."""
    target_modules: Literal["all-linear"] | tuple[str, ...] = "all-linear"
    """``all-linear``: every linear layer except the output head (``lm_head``); or module
    names, each matching the modules whose dotted name is it or ends with ``.NAME``
    (``q_proj`` matches every layer's ``self_attn.q_proj``). One name may be given as text."""
    modules_to_save: tuple[str, ...] | None = None
    """Modules trained in full next to the adapters (e.g. ``lm_head``), matched like
    ``target_modules``."""

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data: object) -> object:
        if isinstance(data, dict):
            data = dict(data)
            for key in ("target_modules", "modules_to_save"):
                value = data.get(key)
                if isinstance(value, str) and not (key == "target_modules" and value == "all-linear"):
                    data[key] = (value,)
        return data

    @model_validator(mode="after")
    def _names_given(self) -> "LoraConfig":
        if self.target_modules == ():
            raise ValueError("target_modules is empty; name at least one module or use all-linear")
        if self.modules_to_save == ():
            raise ValueError("modules_to_save is empty; leave it unset (null) for none")
        return self


class ModelConfig(_Section):
    path: str = "builtin:tiny"
    """A local HF model directory, or ``builtin:tiny`` (a small Qwen2 built on the spot)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype on load. Mixed precision is ``train.precision``."""
    trust_remote_code: bool = False
    """Run model code shipped inside the model directory. Off unless you trust it."""
    router_aux_loss_coef: float | None = None
    """MoE models: weight of the router load-balancing loss; None uses the model config's."""
    moe: MoeConfig = MoeConfig()
    critic_path: str | None = None
    """PPO: the causal LM whose body the critic starts from; None uses ``path``."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of the full model; None trains every weight."""
    freeze_vision: bool = True
    """Vision-language models: keep the vision tower and the projector fixed, training
    only the language model (with LoRA, ``all-linear`` then adapts only its layers);
    false trains them too. No effect on a text-only model."""


ALGO_PRESETS: dict[str, dict[str, object]] = {
    # Dr. GRPO (Liu et al. 2025): no std scaling, a constant-length normaliser
    "dr_grpo": {"adv_scale": "none", "aggregation": "seq-mean-token-sum-norm"},
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling
    "dapo": {"clip_high": 0.28, "aggregation": "token-mean", "dynamic_sampling": True},
    # GSPO (Zheng et al. 2025): sequence-level ratio with a much narrower clip range
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq-mean-token-mean"},
    # SimPO (Meng et al. 2024): its reward scale and target margin
    "simpo": {"beta": 2.0, "simpo_gamma": 1.0},
}
"""Defaults that differ by ``algo.name``; a key the user sets always wins."""


class AlgoConfig(_Section):
    name: str = "grpo"
    """A key of ``rltune.algos.ALGORITHMS`` (the registry is the one list of algorithms;
    the run checks the name, and the keys that depend on the algorithm, before loading
    anything, with the closest name on a typo)."""
    group_size: int = Field(8, ge=1)
    """Samples drawn per prompt; the group is the baseline for GRPO/RLOO advantages."""
    adv_scale: Literal["std", "none"] = "std"
    """GRPO divides by the group's reward std; ``none`` is Dr.GRPO."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the group's reward std before dividing (``adv_scale: std``). TRL's GRPO
    trainer adds 1e-4. Another ``eps`` scales a group's advantages by about
    ``1 - Δeps / std``: with one group per batch and the gradient norm clipped, the clip
    removes that factor; otherwise the update differs by it."""
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    """Upper clip of the ratio; above ``clip_low`` is DAPO's clip-higher."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020); None disables it."""
    aggregation: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL-to-reference term; 0 loads no reference model."""
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL term in the loss. With ``kl_in_reward`` the reward uses k1."""
    kl_in_reward: bool = False
    """PPO: subtract ``kl_coef * k1`` from each token's reward instead of adding a loss term."""
    kl_target: float | None = Field(None, gt=0)
    """With ``kl_in_reward``: adapt ``kl_coef`` towards this KL per sequence (Ziegler et al. 2019)."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive KL controller's horizon, in samples."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount over completion tokens (PPO's GAE, REINFORCE++)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE's lambda."""
    epochs: int = Field(1, ge=1)
    """Passes over each step's batch (PPO epochs)."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per epoch; the batch is shuffled and split into this many parts."""
    value_clip: float | None = Field(0.2, gt=0)
    """PPO's critic: clip the new value to within this of the old; None disables it."""
    critic_lr: float | None = Field(None, ge=0)
    """PPO's critic learning rate; None uses ``train.lr``."""
    critic_warmup_steps: int = Field(0, ge=0)
    """PPO: train only the critic for this many steps before the policy moves."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and draw more prompts to refill."""
    max_refill_rounds: int = Field(4, ge=0)
    """Dynamic sampling: extra generation rounds per step before learning on what there is."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong penalty over the last N tokens before ``max_new_tokens``; 0 is off."""
    overlong_penalty: float = Field(1.0, ge=0)
    importance_correction: Literal["none", "token-truncate", "seq-mask"] = "none"
    """Correct for the gap between the generating engine's and the learner's log-probs."""
    importance_cap: float = Field(2.0, gt=1)
    beta: float = Field(0.1, gt=0)
    """DPO/SimPO: the inverse temperature of the implicit reward."""
    dpo_kind: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """DPO ``sigmoid``: conservative DPO; ``robust``: rDPO's assumed label-flip rate."""
    simpo_gamma: float = Field(1.0, ge=0)
    """SimPO's target reward margin."""
    skip_zero_advantage: bool = False
    """Selective backprop: samples whose advantage is zero at every token get no forward or
    backward; they stay in the loss's denominator, so the update is unchanged."""

    @model_validator(mode="before")
    @classmethod
    def _presets(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("name") in ALGO_PRESETS:
            return {**ALGO_PRESETS[data["name"]], **data}
        return data


class DataConfig(_Section):
    train: str = "builtin:arith/train"
    """jsonl / parquet file, a local HF ``datasets`` directory, or ``builtin:TASK/SPLIT``."""
    eval: str | None = None
    prompt_field: str = "prompt"
    """Field with the prompt: a string, or a list of ``{role, content}`` messages."""
    completion_field: str = "completion"
    """SFT only: the field with the target completion."""
    chosen_field: str = "chosen"
    """Preference data (DPO, SimPO, reward model): the preferred response."""
    rejected_field: str = "rejected"
    """Preference data: the dispreferred response."""
    id_field: str | None = None
    """Field used as the prompt id; None numbers rows ``FILE:ROW``."""
    system_prompt: str | None = None
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Counts a vision-language prompt's image tokens too."""
    images_field: str = "images"
    """Field with a row's images (a list of paths, data URIs or bytes), placed before the
    text of the first user turn; images may also be image parts of the messages."""
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    """An image's width x height, read from its header before it is decoded: past it the
    row is bad. 4096x4096 passes 4K frames and phone photos; a decompression bomb never decodes."""
    max_image_bytes: int = Field(32 * 2**20, ge=1)
    """The largest encoded image file (bytes) a row may hold."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A row with a missing field, an empty prompt, a too-long prompt or an image that is
    missing, unreadable or too large: stop with an error naming file and row, or skip it
    and count it."""
    shuffle: bool = True


class RolloutConfig(_Section):
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    engine: Literal["hf", "vllm"] = "hf"
    """``hf``: rltune's sampler on the transformers model (CPU or GPU; the local runtime
    shares the learner's module). ``vllm``: a vLLM engine holding its own copy of the
    weights, updated in place after each step (the ``vllm`` extra; GPU)."""
    vllm: VLLMConfig = VLLMConfig()
    """The vLLM engine's settings; with ``engine: hf`` they must stay at their defaults."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """The precision the ``hf`` engine samples in (autocast around its forwards; vLLM:
    its ``dtype``). ``auto``: the learner's ``train.precision`` (bf16 for fp8), so that
    the sampled log-probs come from the arithmetic the learner trains with."""
    compile: bool = False
    """``hf`` engine: decode over a static KV cache with the step compiled (``torch.compile``;
    CUDA graphs on a GPU; on a CPU in float32 one native call a step on oneDNN-packed
    weights, which needs a C++ compiler). The first generate call compiles (about 20 s on a
    2-core CPU, a few seconds once inductor's on-disk cache holds the graph). See
    ``docs/performance.md`` for where it pays."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the generator when it runs in a producer thread of the
    learner's process (``runtime.mode: local`` with ``runtime.max_staleness > 0``), so that
    generation and learning, which then run at once, do not compete for one pool of
    threads. None: half of the threads torch would use (at least 1), and ``train.threads``
    left unset gets the rest (``rltune.runtime.rollouts.thread_shares``). Refused
    otherwise: a synchronous run generates on the learner's ``train.threads``, and Ray's
    generator actors on their reserved CPUs."""

    @model_validator(mode="after")
    def _vllm_sampling(self) -> "RolloutConfig":
        if self.engine == "vllm" and self.temperature > 0 and (self.top_k or self.top_p < 1.0):
            raise ValueError(
                "rollout.engine=vllm samples with top_k: 0 and top_p: 1.0 only: vLLM reports "
                "log-probs of the filtered distribution, which the learner's would not match"
            )
        if self.engine == "vllm" and self.compile:
            raise ValueError(
                "rollout.compile compiles rltune's own (hf engine) decode step; a vLLM engine "
                "compiles and captures its graphs itself (rollout.vllm.enforce_eager: false): "
                "set rollout.compile=false with rollout.engine=vllm"
            )
        return self


class RewardFnConfig(_Section):
    fn: str
    """``module:function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    name: str | None = None
    """Name in metrics and samples; defaults to the function's name."""
    kwargs: dict[str, object] = Field(default_factory=dict)
    """Extra keyword arguments passed on every call."""
    timeout_s: float | None = Field(60.0, gt=0)
    """The most one call may take (a batched function's call covers the whole round); past
    it the samples are errors. None: no limit."""
    cache: bool = True
    """Reuse the value of an identical (prompt, completion) call; off for a reward that is
    not a function of its inputs."""
    accuracy: bool | None = None
    """Log the share of samples scoring 1.0 as ``accuracy/NAME`` (a pass/fail verifier).
    None: when the function is marked as a verifier (the built-in answer checkers are)."""


class EnvConfig(_Section):
    """A multi-turn environment (``rltune.envs``): episodes instead of single completions."""

    name: str | None = None
    """``builtin:NAME`` (``tools``), ``module:factory`` or ``path/to/file.py:factory``; the
    factory is called with ``kwargs`` once per episode and returns an Environment. None:
    single-turn generation (the other ``env`` keys then stay at their defaults). Only a run
    that generates plays episodes: an online algorithm, or SFT's evaluation on ``data.eval``."""
    kwargs: dict[str, object] = Field(default_factory=dict)
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode; the episode ends after the last one."""
    max_total_tokens: int = Field(512, ge=1)
    """Completion tokens per episode, the model's and the environment's together; an
    episode that reaches it ends with finish_reason ``length``. Each turn generates at most
    ``rollout.max_new_tokens``."""


class WandbConfig(_Section):
    """Weights & Biases (``pip install 'rltune[wandb]'``); its files go under the run
    directory. ``offline`` needs no account or network (``wandb sync`` uploads later)."""

    project: str = "rltune"
    mode: Literal["offline", "online"] = "offline"
    entity: str | None = None
    name: str | None = None
    """Run name; None uses the config's ``name``."""
    tags: list[str] = Field(default_factory=list)


class MlflowConfig(_Section):
    """MLflow (``pip install 'rltune[mlflow]'``)."""

    tracking_uri: str | None = None
    """None: a local store in the run directory (``sqlite:///RUN/mlflow.db``); a
    ``file:`` URI, a database URI or a tracking server's ``http(s)://`` address."""
    experiment: str = "rltune"
    run_name: str | None = None
    """None uses the config's ``name``."""


class LogConfig(_Section):
    dir: str = "runs"
    console: bool = True
    samples_per_step: int | None = Field(None, ge=0)
    """Rollouts written to samples.jsonl per step; None writes all."""
    tensorboard: bool = False
    """Also write TensorBoard event files to ``RUN/tensorboard`` (``pip install 'rltune[tensorboard]'``)."""
    wandb: WandbConfig | None = None
    """Also log to Weights & Biases; ``log.wandb: {}`` for the defaults (offline)."""
    mlflow: MlflowConfig | None = None
    """Also log to MLflow; ``log.mlflow: {}`` for the defaults (a store in the run directory)."""


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)
    """Save every N steps; 0 saves only at the end."""
    keep: int = Field(2, ge=1)
    resume: str = "never"
    """``never`` (a new run, in an absent or empty ``log.dir/NAME``), ``auto`` (the newest
    complete checkpoint of this run, if any) or a path; ``runtime/rundir.py`` lists what a
    resume may change."""
    overwrite: bool = False
    """With ``resume: never``: move an existing run directory aside to ``NAME.old-N``."""
    final: bool = True
    """Also write the final model as an HF directory (``RUN/final``)."""

    @model_validator(mode="after")
    def _fresh_only(self) -> "CheckpointConfig":
        if self.overwrite and self.resume != "never":
            raise ValueError(f"overwrite starts afresh; it cannot be combined with resume={self.resume} "
                             f"(set checkpoint.resume=never, or drop checkpoint.overwrite)")
        return self


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Evaluate every N steps; 0 only before and after training (when ``data.eval`` is set)."""
    max_prompts: int | None = Field(None, ge=1)
    batch_size: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0)
    """0 is greedy."""
    max_new_tokens: int | None = Field(None, ge=1)
    """None uses ``rollout.max_new_tokens``."""


class Config(_Section):
    name: str = "run"
    model: ModelConfig = ModelConfig()
    algo: AlgoConfig = AlgoConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: tuple[RewardFnConfig, ...] = ()
    env: EnvConfig = EnvConfig()
    train: TrainConfig = TrainConfig()
    log: LogConfig = LogConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _check(self) -> "Config":
        """Checks across sections that hold for every algorithm; those that depend on
        which algorithm it is are the registry's (``rltune.algos.config_problems``)."""
        for problem in _algo_problems(self.algo) + _reward_name_problems(self) + moe_problems(
                self.model.moe, engine=self.rollout.engine, env=self.env.name, lora=self.model.lora is not None):
            raise ValueError(problem)
        placement = self.runtime.placement
        for problem in offload_problems(self.train, mode=self.runtime.mode, device=self.runtime.device,
                                        learners=placement.learners,
                                        learner_strategy=placement.learner_strategy,
                                        learner_gpus=placement.learner.gpus):
            raise ValueError(problem)
        if self.runtime.max_staleness > 0 and self.algo.importance_correction == "none":
            raise ValueError(
                "runtime.max_staleness > 0 learns on samples of older policies; set "
                "algo.importance_correction to token-truncate or seq-mask so the loss "
                "weighs them by the engine's log-probs"
            )
        tp = self.rollout.vllm.tensor_parallel_size
        if tp > 1 and (self.rollout.engine != "vllm" or (
                self.runtime.mode == "ray" and self.runtime.placement.generator.gpus < tp)):
            raise ValueError(
                f"rollout.vllm.tensor_parallel_size={tp} splits a vLLM engine over {tp} GPUs: it needs "
                f"rollout.engine=vllm and, on Ray, runtime.placement.generator.gpus >= {tp} "
                f"(now engine={self.rollout.engine}, generator.gpus={self.runtime.placement.generator.gpus})"
            )
        if self.rollout.engine == "vllm" and self.model.lora is not None:
            raise ValueError(
                "rollout.engine=vllm loads whole weights into the engine; model.lora trains "
                "adapters: use rollout.engine=hf with LoRA"
            )
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name {self.name!r} must be a plain directory name")
        return self


def _algo_problems(a: AlgoConfig) -> list[str]:
    """Combinations of ``algo`` keys that would silently do nothing or fail mid-run."""
    problems = []
    if a.kl_target is not None and not (a.kl_in_reward and a.kl_coef > 0):
        problems.append("algo.kl_target adapts the KL in the reward: set algo.kl_in_reward: true and algo.kl_coef > 0")
    if a.label_smoothing > 0 and a.dpo_kind in ("ipo", "hinge"):
        problems.append(f"algo.label_smoothing is for dpo_kind sigmoid or robust, not {a.dpo_kind}")
    return problems


def _reward_name_problems(cfg: Config) -> list[str]:
    """Reward functions whose name (``name``, else the function's name in ``fn``) is a
    segment that metric keys reserve (``rltune.metrics.keys``): a statistic of the total
    (``mean``, ``std``, ``errors``, ...), or a reward the runtime adds itself to this run
    (``env`` with an environment, ``overlong`` with ``algo.overlong_buffer``)."""
    added = {ENV_REWARD} if cfg.env.name is not None else set()
    added |= {OVERLONG_REWARD} if cfg.algo.overlong_buffer > 0 else set()
    problems = []
    for i, entry in enumerate(cfg.reward):
        name = entry.name if entry.name is not None else entry.fn.rpartition(":")[2].strip()
        if not name and entry.name is None:  # the spec is wrong, not the name
            problems.append(f"reward[{i}].fn={entry.fn!r} names no function after ':'; "
                            "expected `module:function` or `path/to/file.py:function`")
            continue
        problem = reward_name_problem(name, runtime_rewards=added)
        if problem is not None:
            problems.append(f"reward[{i}] ({entry.fn}): {problem}; give it another `name:`")
    return problems
