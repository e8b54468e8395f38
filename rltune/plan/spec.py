"""The records the planner's parts share: the model's shape, the cluster, the workload a
config asks for, one candidate layout, and what the cost model says about it.

Units everywhere: bytes, seconds, FLOPs, bytes per second; ``*_gb`` fields are 10^9
bytes and ``*_gbps`` fields are 10^9 bytes per second (GB/s, not Gb/s). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from rltune.parallel.layout import Layout

GB = 1e9

LearnerLayout = Layout
"""The learner group's degrees (``train.parallel``; their product is its size): the same
record ``rltune train`` checks a layout with, so a plan's layout is one it accepts."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape, as its ``config.json`` gives it (Llama, Qwen2,
    Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE). Per layer: attention with ``heads``
    query heads and ``kv_heads`` key/value heads of ``head_dim``, then a gated MLP
    (gate, up, down) of width ``intermediate``, or, in MoE layers, ``experts`` routed
    gated MLPs of width ``expert_intermediate`` of which ``experts_per_token`` run per
    token, plus a shared expert of ``shared_expert_intermediate`` (0: none)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """Dense MLP width (of every layer of a dense model; of the ``dense_layers`` of an MoE)."""
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    """Biases on q, k and v (Qwen2)."""
    o_bias: bool = False
    """A bias on the attention's output projection too (Llama's and Qwen3's
    ``attention_bias: true`` puts one on q, k, v and o)."""
    qk_norm: bool = False
    """RMSNorm of q and k per head (Qwen3)."""
    experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    dense_layers: int = 0
    """With ``experts`` > 0: how many layers (the first ones) keep a dense MLP."""
    router_aux_loss_coef: float = 0.0
    """An MoE model's own load-balancing loss coefficient (its ``config.json``'s, else
    transformers' default 0.001), which ``model.router_aux_loss_coef`` may replace; a
    non-zero one rules out pipeline stages (``rltune.parallel.layout.PP_AUX_LOSS``)."""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class Cluster:
    """The devices a run may use. Defaults: a node of 8 H100 SXM 80 GB (989 dense bf16
    TFLOP/s, 3.35 TB/s HBM, NVLink 450 GB/s a direction, 400 Gb/s InfiniBand = 50 GB/s per
    GPU, PCIe 5 x16 = 55 GB/s to the host)."""

    gpus: int
    gpus_per_node: int = 8
    memory_gb: float = 80.0
    tflops: float = 989.0
    """Peak dense matmul rate of one device at 16-bit precision, 10^12 FLOP/s (fp32 runs
    at ``fp32_ratio`` of it, fp8 at twice it)."""
    hbm_gbps: float = 3350.0
    """Device memory bandwidth."""
    intra_gbps: float = 450.0
    """Bandwidth between two devices of one node, per device and direction."""
    inter_gbps: float = 50.0
    """Bandwidth of one device to another node, per direction."""
    host_gbps: float = 55.0
    """Device to host memory (offload), per direction."""
    fp32_ratio: float = 67.0 / 989.0
    """fp32 matmul rate / 16-bit rate (H100: 67 TF32-off TFLOP/s against 989)."""
    kind: Literal["gpu", "cpu"] = "gpu"
    name: str = "H100 SXM 80GB"
    fp8: bool = True
    """The device runs float8 matmuls (compute capability 8.9 or more: Ada, Hopper,
    Blackwell), which ``train.precision: fp8`` needs (``rltune/learner/precision.py``)."""

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Workload:
    """What one training step of the config does, independent of the layout."""

    algo: str
    generates: bool
    """False for algorithms that learn from a fixed dataset (DPO, SFT): no generator."""
    critic: bool
    """A value model trained beside the policy (PPO)."""
    reference: bool
    """A frozen reference model evaluated on every batch (KL against it, or DPO's)."""
    prompts_per_step: int
    group_size: int
    """Samples per prompt (1 for PPO-style algorithms; 2, chosen and rejected, for DPO)."""
    prompt_tokens: int
    completion_tokens: int
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "bf16"
    rollout_precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    lora_rank: int | None = None
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    """``model.dtype``: the dtype the learner's (and reference's, critic's) parameters are
    stored in; ``precision`` is the autocast over them (``rltune/learner/precision.py``)."""
    logprob_chunk_tokens: int = 1024
    """``train.logprob_chunk_tokens``: completion tokens whose float32 logits exist at once
    in the learner (0: all of a micro-batch's)."""
    epochs: int = 1
    minibatches: int = 1
    max_staleness: int = 0

    @property
    def samples_per_step(self) -> int:
        """Sequences the learner trains on per step."""
        return self.prompts_per_step * self.group_size

    @property
    def tokens_per_sample(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Candidate:
    """One layout the search considers."""

    learner: LearnerLayout
    generator_tp: int = 1
    generator_replicas: int = 1
    colocate: bool = False
    """Generators on the learners' devices, taking turns with them (weights swapped, not
    sent over the network); False: generators on devices of their own."""
    micro_batch_tokens: int = 8192
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    offload: Literal["none", "optimizer", "params"] = "none"
    max_staleness: int = 0
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """``runtime.weight_sync``: how new weights reach generators on devices of their own
    (rltune's default, ``object_store``; ``broadcast`` is a collective from learner rank 0)."""

    @property
    def learner_gpus(self) -> int:
        return self.learner.world

    @property
    def generator_gpus(self) -> int:
        """Devices of the generators' own (0 when colocated)."""
        return 0 if self.colocate else self.generator_tp * self.generator_replicas

    @property
    def gpus(self) -> int:
        return self.learner_gpus + self.generator_gpus


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one device of a role holds at its peak, by kind."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    master: float = 0.0
    """fp32 master copy of 16-bit weights."""
    activations: float = 0.0
    logits: float = 0.0
    kv_cache: float = 0.0
    reference: float = 0.0
    critic: float = 0.0
    """The value model's weights, gradients and optimizer state."""
    workspace: float = 0.0
    """Communication buffers, allocator fragmentation, the framework's own."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_gb(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) / GB for f in fields(self)} | {"total": self.total / GB}


@dataclass(frozen=True)
class Efficiency:
    """How much of a device's peak each kind of work reaches; what ``plan --calibrate``
    fits on the machine at hand. The defaults are typical of an H100 with PyTorch."""

    train_mfu: float = 0.40
    """Achieved / peak FLOP rate of the learner's forward and backward."""
    prefill_mfu: float = 0.50
    decode_bandwidth: float = 0.60
    """Achieved / peak memory bandwidth of a decode step that is bound by reading weights
    and KV cache."""
    decode_mfu: float = 0.30
    """Achieved / peak FLOP rate of a decode step that is bound by compute (large batches)."""
    layer_overhead_s: float = 0.0
    """Fixed time per layer per forward call (kernel launches, Python); dominates small
    models on CPU, ~0 under CUDA graphs."""
    token_overhead_s: float = 0.0
    """Time per token per layer per forward-equivalent of the work that is neither a matmul
    nor a fixed per-call cost (norms, rotary, softmax, activation functions: element-wise
    kernels whose cost grows with the tokens, not with the weights); 0: not modelled.
    ``plan --calibrate`` fits it where the timing model uses it."""
    step_overhead_s: float = 0.0
    """Fixed time per learner step (optimizer launch, bookkeeping)."""
    comm_bandwidth: float = 0.75
    """Achieved / link bandwidth of a large collective."""
    comm_latency_s: float = 3e-6
    """Latency of one collective per hop of a ring: NCCL's low-latency protocols, which it
    picks for small messages, take ~1-2 us a hop over NVLink (Hu et al. 2025, "Demystifying
    NCCL"), an InfiniBand hop a few us."""
    score_s: float = 0.0
    """Seconds to score one sample (the reward function), when not overlapped."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, by phase, and the step's wall time once the phases
    that overlap (generation ahead of learning with ``max_staleness`` > 0) are overlapped."""

    prefill: float = 0.0
    decode: float = 0.0
    score: float = 0.0
    reference: float = 0.0
    """Forward passes without gradient: the reference model, old log-probs, the critic's
    values before the update."""
    forward_backward: float = 0.0
    optimizer: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)
    """Communication not hidden behind compute, by kind: ``fsdp``, ``dp``, ``tp``, ``ep``,
    ``pp_bubble``, ``offload``."""
    weight_sync: float = 0.0
    step: float = 0.0
    """Wall seconds per step."""

    @property
    def generate(self) -> float:
        return self.prefill + self.decode

    @property
    def learn(self) -> float:
        return self.reference + self.forward_backward + self.optimizer + sum(self.comm.values())


@dataclass(frozen=True)
class Plan:
    """One candidate with its memory, time and whether it fits."""

    candidate: Candidate
    memory: dict[str, RoleMemory]
    """Per device, by role: ``learner``, ``generator``."""
    time: StepTime
    samples_per_s: float
    problems: tuple[str, ...] = ()
    """Why it does not fit, one line each ("learner needs 94 GB per device at dp_shard=4,
    has 80"); empty when it fits."""
    utilisation: dict[str, float] = field(default_factory=dict)
    """Busy share of each role's devices over a step: ``generator``, ``learner``."""

    @property
    def fits(self) -> bool:
        return not self.problems
