"""Bytes per device per role for a :class:`~rltune.plan.spec.Candidate`: what the learner
and the generator hold at their peak, term by term, as rltune runs them.

**Model states** (:func:`bytes_per_param`). rltune keeps the parameters in ``model.dtype``
(fp32 by default) whatever ``train.precision`` is: bf16, fp16 and fp8 are autocast over
them (``rltune/learner/precision.py``), FSDP2 runs without a mixed-precision policy and
AdamW's moments take the parameters' dtype. An fp32 model therefore holds 4 (weights) +
4 (gradients) + 8 (two moments) = 16 bytes per trained parameter and no separate master
copy. The ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 3.1) also comes to 16
bytes, split differently: 2 (fp16 weights) + 2 (fp16 gradients) + 12 (fp32 master, momentum,
variance). A ``model.dtype: bfloat16`` model keeps all of it in bf16: 2 + 2 + 4 = 8.

**Sharding** (:func:`param_split`), as ``docs/parallel.md`` describes rltune's mesh
``pp x dp_replicate x dp_shard x ep x tp``: a pipeline stage holds its layers
(``rltune.parallel.pipeline.stage_layer_ranges``; the first stage the embedding, the last
the head: the largest stage is taken); ``tp`` splits attention, dense MLPs, shared experts
and the vocabulary (embedding, head); routed experts are replicated over ``tp`` and split
over ``ep``; FSDP2 shards the dense weights over ``dp_shard x ep`` and the experts over
``dp_shard`` (weights, gradients and optimizer state alike: ZeRO-3); ``dp_replicate``
shards nothing.

**Activations** (:func:`layer_activation_bytes`): Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", eq. 1-2, adapted to the blocks
rltune trains (RMSNorm, GQA, SDPA, gated MLP, no dropout): see that function.

**Logits** (:func:`logits_bytes`), the **reference** and the **critic**
(:func:`reference_bytes`, :func:`critic_bytes`), the **generator** (:func:`kv_cache_bytes`,
:func:`generator_memory`) and the fixed **workspace** (:func:`workspace_bytes`) are each
documented where they are computed. ``docs/plan.md`` lists every term with its source and
the check against rltune's measured memory table.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from rltune.plan.catalogue import (
    block_params,
    embedding_params,
    expert_params,
    kv_bytes_per_token,
    lora_params,
    param_count,
    sparse_in,
)
from rltune.plan.bounds import MAX_GPUS
from rltune.plan.errors import PlanError
from rltune.plan.spec import GB, Candidate, Cluster, LearnerLayout, ModelSpec, RoleMemory, Workload

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "fp8": 1}
"""Bytes per value of each precision or dtype name."""
CHECKPOINT_EVERY = 2
"""``train.checkpoint_every``'s default: ``selective`` checkpoints the 2nd, 4th, ... block."""
LOGIT_COPIES = 4
"""float32 ``[c, V]`` tensors alive at the peak of one log-prob chunk's backward: the
temperature-scaled logits kept for ``logsumexp``'s backward, then the softmax, the
gather's scattered gradient and their sum (``rltune/models/chunked.py``, ``token_logprobs``)."""
GATHERED_LAYERS = 2
"""Blocks whose parameters FSDP2 holds all-gathered at once: the one computing and the
next, prefetched (PyTorch FSDP2 ``fully_shard`` docs: implicit forward/backward prefetch)."""
CUDA_CONTEXT_BYTES = 1.0e9
"""Per GPU process: the CUDA context, cuBLAS/cuDNN workspaces and NCCL communicators
(PyTorch CUDA semantics notes: the context alone is ~0.3-1 GB depending on GPU and CUDA
version; lazy module loading keeps it at the low end). A round 1 GB."""
ALLOCATOR_FRAGMENTATION = 0.10
"""Share of the allocated bytes that the caching allocator reserves on top of them
(fragmentation of its blocks; PyTorch CUDA semantics, "memory management",
``expandable_segments`` exists to reduce it). 10 % is the usual planning margin."""
CPU_PROCESS_BYTES = 365e6
"""Resident size of a CPU learner process before its model: Python with torch 2.13,
transformers 5.25 and rltune's learner imported, measured on this project's machine
(``ru_maxrss`` = 347.6 MiB, docs/plan.md)."""
GENERATOR_WORKSPACE_BYTES = 1.0e9
"""vLLM's own beyond weights and KV cache: the CUDA graphs captured for its decode batch
sizes (under 1 GiB at the default capture sizes up to 512 sequences) and the activations
of its profiling forward of ``max_num_batched_tokens``; added to :data:`CUDA_CONTEXT_BYTES`.
Larger capture sizes take more (vLLM reports the figure at start: "Graph capturing
finished ... took X GiB")."""


# ----------------------------------------------------------------------- model states


def bytes_per_param(precision: str, *, lora: bool = False, model_dtype: str = "float32") -> dict[str, float]:
    """Bytes of ``weights``, ``gradients``, ``optimizer`` (AdamW's two moments) and
    ``master`` per parameter, as rltune trains at ``train.precision = precision`` over
    parameters stored in ``model_dtype`` (module docstring): weights w = bytes of
    ``model_dtype``, gradients w, optimizer 2w, master 0; fp32: 4 + 4 + 8 + 0 = 16.
    ``precision`` changes none of them (autocast computes in 16 bits over the stored
    weights; its 16-bit weight copies are counted with the activations).

    ``lora``: the bytes of a frozen base parameter (weights only, in ``model_dtype``); the
    adapters' own parameters take the full-training bytes."""
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise PlanError(f"train.precision={precision!r}: expected fp32, bf16, fp16 or fp8")
    if model_dtype not in ("float32", "bfloat16"):
        raise PlanError(f"model.dtype={model_dtype!r}: expected float32 or bfloat16")
    w = DTYPE_BYTES[model_dtype]
    if lora:
        return {"weights": w, "gradients": 0.0, "optimizer": 0.0, "master": 0.0}
    return {"weights": w, "gradients": w, "optimizer": 2.0 * w, "master": 0.0}


def _routed_per_layer(spec: ModelSpec) -> float:
    sparse = sparse_in(spec, 0, spec.layers)
    return expert_params(spec) / sparse if sparse else 0.0


def stage_layers(layers: int, pp: int) -> list[range]:
    """The layers of each pipeline stage, as ``rltune.parallel.pipeline.stage_layer_ranges``
    cuts them: ``layers // pp`` each, one more for the first ``layers % pp`` stages."""
    if not 1 <= pp <= layers:
        raise PlanError(f"train.parallel.pp={pp} for a model of {layers} layers: pp must be 1..{layers}")
    base, extra = divmod(layers, pp)
    sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    return [range(sum(sizes[:s]), sum(sizes[: s + 1])) for s in range(pp)]


@functools.lru_cache(maxsize=4096)  # the search asks again for every candidate of a layout
def param_split(spec: ModelSpec, layout: LearnerLayout) -> tuple[float, float]:
    """``(dense, routed)``: parameters of the largest pipeline stage that one device of
    ``layout`` holds before FSDP sharding, split by how they shard. dense = (stage layers'
    non-expert parameters + the stage's embedding or head) / tp (vocabulary-parallel
    embedding and head; norms, biases and routers counted as split too, a < 0.1 % error);
    routed = the stage's routed experts / ep (replicated over tp). With pp > 1 and tied
    embeddings the first and last stages each hold the matrix."""
    routed = _routed_per_layer(spec)
    table = spec.vocab * spec.hidden
    best: tuple[float, float] = (0.0, 0.0)
    stages = stage_layers(spec.layers, layout.pp)
    for index, span in enumerate(stages):
        sparse = sparse_in(spec, span.start, span.stop)
        experts = routed * sparse
        blocks = (len(span) - sparse) * block_params(spec, sparse=False) + sparse * block_params(spec, sparse=True)
        dense = blocks - experts
        if layout.pp == 1:
            dense += embedding_params(spec) + spec.hidden
        else:
            dense += table * ((index == 0) + (index == len(stages) - 1)) + spec.hidden * (index == len(stages) - 1)
        stage = (dense / layout.tp, experts / layout.ep)
        if sum(stage) > sum(best):
            best = stage
    return best


def sharded_params(spec: ModelSpec, layout: LearnerLayout) -> float:
    """Parameters whose states one device keeps: :func:`param_split`'s dense part over
    FSDP's ``dp_shard x ep`` and its routed part over ``dp_shard`` (``docs/parallel.md``)."""
    dense, routed = param_split(spec, layout)
    return dense / (layout.dp_shard * layout.ep) + routed / layout.dp_shard


def model_state_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> dict[str, float]:
    """Weights, gradients, optimizer state and master copy on one learner device:
    :func:`bytes_per_param` times :func:`sharded_params`; with LoRA the base weights
    frozen and the adapters (sharded like the weights) trained. ``offload: optimizer``
    moves the optimizer state to the host (0 here); ``offload: params`` all of it, the
    device keeping only :data:`GATHERED_LAYERS` blocks' gathered weights and one block's
    gradients (FSDP2's ``CPUOffloadPolicy``)."""
    layout = cand.learner
    full = bytes_per_param(work.precision, model_dtype=work.model_dtype)
    held = sharded_params(spec, layout)
    if work.lora_rank:
        share = held / param_count(spec)
        adapters = lora_params(spec, work.lora_rank) * share
        base = bytes_per_param(work.precision, lora=True, model_dtype=work.model_dtype)
        out = {k: base[k] * held + full[k] * adapters for k in full}
    else:
        out = {k: full[k] * held for k in full}
    if cand.offload == "optimizer":
        out["optimizer"] = out["master"] = 0.0
    elif cand.offload == "params":
        block = _largest_block(spec, layout)
        out = {"weights": GATHERED_LAYERS * block * full["weights"], "gradients": block * full["gradients"],
               "optimizer": 0.0, "master": 0.0}
    return out


def host_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """Host memory one learner process needs for what ``offload`` moved there:
    ``optimizer`` (``HostOffloadAdamW``: host copies of the weights and gradients and the
    moments, 4 + 4 + 8 bytes per fp32 parameter); ``params`` (the shards of weights,
    gradients and moments); 0 without offload."""
    if cand.offload == "none":
        return 0.0
    per = bytes_per_param(work.precision, model_dtype=work.model_dtype)
    trained = lora_params(spec, work.lora_rank) / param_count(spec) if work.lora_rank else 1.0
    held = sharded_params(spec, cand.learner)
    if cand.offload == "optimizer":
        return held * trained * (per["weights"] + per["gradients"] + per["optimizer"])
    return held * (per["weights"] + trained * (per["gradients"] + per["optimizer"]))


# ------------------------------------------------------------------------ activations


def compute_bytes(work: Workload) -> float:
    """Bytes of an activation value: 2 under 16-bit autocast (bf16, fp16; fp8's float8
    linears sit inside bf16 autocast), else those of ``model.dtype``."""
    return 2.0 if work.precision != "fp32" else DTYPE_BYTES[work.model_dtype]


def layer_activation_bytes(spec: ModelSpec, *, sparse: bool, compute: float, tp: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes one token leaves saved for the backward in one transformer block.

    Korthikanti et al. 2022, eq. 1: ``s b h (34 + 5 a s / h)`` bytes per layer at 2-byte
    activations = attention ``11 sbh + 5 a s^2 b`` + MLP ``19 sbh`` + layer norms ``4 sbh``.
    With SDPA (flash or memory-efficient attention, what rltune's models run) the
    ``a s^2`` scores are not kept and the ``5 a s / h`` term goes; without dropout its
    masks go. Counted per token for an RMSNorm / GQA / gated-MLP block, in values:

    * two RMSNorms, each keeping its input and its normalised output in fp32 (Hugging Face
      upcasts inside the norm): ``4 h`` values of 4 bytes;
    * attention: the q/k/v projections' input ``h``, q ``Hq = heads x head_dim`` and k, v
      ``Hkv = kv_heads x head_dim`` each (after RoPE, kept by SDPA), the attention output
      ``Hq`` (o's input): ``h + 2 Hq + 2 Hkv`` values of ``compute`` bytes, plus SDPA's
      log-sum-exp (``heads`` fp32) and, with q/k norms, their input and output
      (``2 (Hq + Hkv)`` fp32). For multi-head attention (``Hq = Hkv = h``) this is
      Korthikanti's ``5 h`` (11 sbh bytes less the 1-byte dropout mask);
    * a dense gated MLP: its input ``h``, gate and up outputs ``I`` each, ``silu(gate)``
      ``I`` and the product ``I`` (down's input): ``h + 4 I`` (Korthikanti's GeLU MLP:
      ``h + 2 I``);
    * an MoE MLP: the router's logits (``experts`` fp32), and for each of the
      ``experts_per_token`` routed copies of the token ``h + 4 I_e``, plus a shared expert
      ``h + 4 I_s``.

    Tensor parallelism without sequence parallelism (rltune's default) leaves the norms
    and the inputs of the two tensor-parallel regions (``2 h``) whole and splits the rest
    over ``tp`` (Korthikanti eq. 2, ``sbh (10 + 24/t)``); routed experts are replicated
    over tp in rltune, so not split. With sequence parallelism everything is split."""
    h, q, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    whole = 4 * h * 4.0 + 2 * h * compute
    split = (2 * q + 2 * kv) * compute + spec.heads * 4.0 + (2 * (q + kv) * 4.0 if spec.qk_norm else 0.0)
    if not sparse:
        split += 4 * spec.intermediate * compute
    else:
        if spec.shared_expert_intermediate:
            split += (h + 4 * spec.shared_expert_intermediate) * compute
        whole += spec.experts * 4.0 + spec.experts_per_token * (h + 4 * spec.expert_intermediate) * compute
    if sequence_parallel:
        return (whole + split) / tp
    return whole + split / tp


def micro_batches(work: Workload, cand: Candidate) -> tuple[int, int]:
    """``(rows, count)``: rows of one learner micro-batch and micro-batches per optimizer
    step on one rank. A rank trains ``ceil(samples / minibatches / data_world)`` rows per
    update; a micro-batch takes as many whole rows of ``tokens_per_sample`` as
    ``micro_batch_tokens`` holds, at least one (``train.micro_batch_tokens``)."""
    per_rank = math.ceil(work.samples_per_step / work.minibatches / cand.learner.data_world)
    fit = max(1, cand.micro_batch_tokens // work.tokens_per_sample)
    return min(fit, per_rank), math.ceil(per_rank / fit)


def pipeline_in_flight(work: Workload, cand: Candidate) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: 1 without
    a pipeline; GPipe runs every forward before any backward (all of the step's); 1F1B
    at most ``pp`` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM", section 2.2.1)."""
    _, count = micro_batches(work, cand)
    if cand.learner.pp == 1:
        return 1
    return count if cand.learner.pp_schedule == "gpipe" else min(cand.learner.pp, count)


def checkpointed_count(lo: int, hi: int, mode: str) -> int:
    """How many of blocks ``lo .. hi - 1`` (global indices) ``mode`` checkpoints, as
    ``rltune.learner.memory.checkpointed_indices`` picks them: none, all (``full``) or
    the k-th, 2k-th, ... (``selective``, k = :data:`CHECKPOINT_EVERY`: block i when
    ``(i + 1) % k == 0``, so ``hi // k - lo // k`` of them)."""
    if mode == "none":
        return 0
    if mode == "full":
        return max(0, hi - lo)
    if mode == "selective":
        return max(0, hi // CHECKPOINT_EVERY - lo // CHECKPOINT_EVERY)
    raise PlanError(f"train.activation_checkpointing={mode!r}: expected none, full or selective")


def activation_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """Activation bytes on the first (largest) pipeline stage's device at the peak of the
    backward: per micro-batch in flight (:func:`pipeline_in_flight`), ``tokens`` (one
    micro-batch, :func:`micro_batches`) times each block's :func:`layer_activation_bytes`,
    or, for a checkpointed block, its input (``h`` in ``model.dtype``, whole over tp);
    plus one checkpointed block's full activations while it is recomputed. Under 16-bit
    autocast over fp32 weights each uncheckpointed block's matmuls also keep the 16-bit
    copies of its weights for the backward (2 bytes per block parameter, /tp, experts /ep).
    Blocks of a kind (dense, MoE) weigh the same, so each kind is counted, not each block."""
    layout = cand.learner
    rows, _ = micro_batches(work, cand)
    tokens = rows * work.tokens_per_sample
    span = stage_layers(spec.layers, layout.pp)[0]
    copies = 2.0 if work.precision != "fp32" and work.model_dtype == "float32" else 0.0
    routed = _routed_per_layer(spec)
    first_sparse = span.stop - sparse_in(spec, span.start, span.stop)
    saved, recompute = 0.0, 0.0
    for sparse, lo, hi in ((False, span.start, first_sparse), (True, first_sparse, span.stop)):
        if hi <= lo:
            continue
        full = tokens * layer_activation_bytes(spec, sparse=sparse, compute=compute_bytes(work), tp=layout.tp)
        experts = routed if sparse else 0.0
        full += copies * ((block_params(spec, sparse=sparse) - experts) / layout.tp + experts / layout.ep)
        kept = checkpointed_count(lo, hi, cand.activation_checkpointing)
        saved += kept * tokens * spec.hidden * DTYPE_BYTES[work.model_dtype] + (hi - lo - kept) * full
        if kept:
            recompute = max(recompute, full)
    return pipeline_in_flight(work, cand) * saved + recompute


def logits_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """The log-prob head's float32 logits at their peak: :data:`LOGIT_COPIES` x ``c`` x
    ``V / tp`` x 4 bytes, ``c`` = ``train.logprob_chunk_tokens`` completion tokens (0 or
    more than the micro-batch holds: the micro-batch's completion tokens; chunks of
    ``rltune/models/chunked.py``), the vocabulary split over tp (vocabulary-parallel head).
    On the last pipeline stage; counted on the device with the largest stage too (an
    upper bound for pp > 1)."""
    rows, _ = micro_batches(work, cand)
    alive = rows * work.completion_tokens
    chunk = min(work.logprob_chunk_tokens, alive) if work.logprob_chunk_tokens > 0 else alive
    return LOGIT_COPIES * chunk * spec.vocab / cand.learner.tp * 4.0


# ------------------------------------------------------------- reference, critic, workspace


def reference_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """The frozen reference model's weights on one learner device: ``model.dtype`` bytes
    per parameter, sharded like the policy (:func:`sharded_params`); it is loaded in
    ``model.dtype`` (``rltune.runtime.roles.load_reference_model``) and runs under no
    gradient, so it keeps no activations past its own forward. With LoRA the reference is
    the policy with its adapters off (no second copy); 0 without a reference."""
    if not work.reference or work.lora_rank:
        return 0.0
    return DTYPE_BYTES[work.model_dtype] * sharded_params(spec, cand.learner)


def critic_params(spec: ModelSpec) -> int:
    """PPO's critic (``rltune/models/value.py``): the policy's body without its LM head,
    plus a ``hidden -> 1`` value head with a bias (an untied head's ``vocab x hidden`` is
    dropped; a tied matrix stays as the body's embedding)."""
    head = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
    return param_count(spec) - head + spec.hidden + 1


def critic_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """The critic's weights, gradients and optimizer state on one learner device: trained
    in full (no LoRA), with the policy's precision, offload and sharding, scaled from the
    policy's by parameter count. Its activations come after the policy's in the step
    (its own update), so only the larger of the two counts: the policy's."""
    if not work.critic:
        return 0.0
    full = dataclasses.replace(work, lora_rank=None)
    states = sum(model_state_bytes(spec, full, cand).values())
    return states * critic_params(spec) / param_count(spec)


def fsdp_buffer_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """FSDP2's unsharded buffers while it computes: :data:`GATHERED_LAYERS` blocks'
    all-gathered weights and one block's unsharded gradients before their reduce-scatter
    (``model.dtype`` bytes, /tp); 0 without sharding (``dp_shard x ep`` = 1) and with
    ``offload: params``, where :func:`model_state_bytes` counts them as the weights."""
    layout = cand.learner
    if layout.dp_shard * layout.ep == 1 or cand.offload == "params":
        return 0.0
    return (GATHERED_LAYERS + 1) * _largest_block(spec, layout) * DTYPE_BYTES[work.model_dtype]


@functools.lru_cache(maxsize=4096)
def _largest_block(spec: ModelSpec, layout: LearnerLayout) -> float:
    """Parameters of the largest block one device computes: dense /tp, routed experts /ep."""
    routed = _routed_per_layer(spec)
    sparse = sparse_in(spec, 0, spec.layers)
    kinds = [kind for kind, count in ((False, spec.layers - sparse), (True, sparse)) if count]
    return max((block_params(spec, sparse=kind) - routed * kind) / layout.tp + routed * kind / layout.ep
               for kind in kinds)


def workspace_bytes(allocated: float, cluster: Cluster) -> float:
    """The device's fixed and proportional overhead over ``allocated`` bytes: on a GPU
    :data:`CUDA_CONTEXT_BYTES` + :data:`ALLOCATOR_FRAGMENTATION` x allocated; on a CPU
    (resident memory, no caching allocator) the process's own :data:`CPU_PROCESS_BYTES`."""
    if cluster.kind == "cpu":
        return CPU_PROCESS_BYTES
    return CUDA_CONTEXT_BYTES + ALLOCATOR_FRAGMENTATION * allocated


# ------------------------------------------------------------------------------- roles


def learner_memory(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster) -> RoleMemory:
    """Bytes one learner device holds at its peak (the backward of a micro-batch): model
    states, activations, logits, the reference and critic sharded like the policy, FSDP's
    gathered buffers and the workspace."""
    states = model_state_bytes(spec, work, cand)
    parts = dict(states, activations=activation_bytes(spec, work, cand), logits=logits_bytes(spec, work, cand),
                 reference=reference_bytes(spec, work, cand), critic=critic_bytes(spec, work, cand))
    allocated = sum(parts.values()) + fsdp_buffer_bytes(spec, work, cand)
    workspace = allocated - sum(parts.values()) + workspace_bytes(allocated, cluster)
    return RoleMemory(workspace=workspace, **parts)


def kv_cache_bytes(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """KV cache of one generator device: every sequence a replica runs at once,
    ``ceil(prompts_per_step x group_size / generator_replicas)``, at its full length
    (prompt + completion) x :func:`~rltune.plan.catalogue.kv_bytes_per_token` in the
    rollout precision, the KV heads split over ``generator_tp`` (replicated when there are
    fewer heads than ranks, as vLLM does). PagedAttention's fragmentation is under 4 %
    (Kwon et al. 2023, section 6) and not counted."""
    sequences = math.ceil(work.prompts_per_step * work.group_size / cand.generator_replicas)
    per_token = kv_bytes_per_token(spec, rollout_bytes(work)) / min(cand.generator_tp, spec.kv_heads)
    return sequences * work.tokens_per_sample * per_token


def rollout_bytes(work: Workload) -> float:
    """Bytes of the generator's weights and KV values: ``rollout.precision``'s (16-bit), or
    with fp32 ``model.dtype``'s (``rltune.learner.precision.vllm_dtype``)."""
    return DTYPE_BYTES[work.model_dtype] if work.rollout_precision == "fp32" else DTYPE_BYTES[work.rollout_precision]


def generator_memory(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster) -> RoleMemory:
    """Bytes one generator device holds: the weights in the rollout precision over
    ``generator_tp``, :func:`kv_cache_bytes`, and on a GPU the CUDA context plus
    :data:`GENERATOR_WORKSPACE_BYTES` (vLLM allocates its KV blocks up front, so no
    allocator fragmentation); all zeros for a workload that does not generate."""
    if not work.generates:
        return RoleMemory()
    weights = param_count(spec) * rollout_bytes(work) / cand.generator_tp
    overhead = CPU_PROCESS_BYTES if cluster.kind == "cpu" else CUDA_CONTEXT_BYTES + GENERATOR_WORKSPACE_BYTES
    return RoleMemory(weights=weights, kv_cache=kv_cache_bytes(spec, work, cand), workspace=overhead)


def _layout_text(layout: LearnerLayout) -> str:
    extra = [f"{k}={getattr(layout, k)}" for k in ("dp_replicate", "ep") if getattr(layout, k) > 1]
    return " ".join([f"dp_shard={layout.dp_shard}", f"tp={layout.tp}", f"pp={layout.pp}", *extra])


def memory_problems(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster) -> list[str]:
    """One line per role that does not fit a device of ``cluster`` (empty when all fit).
    Colocated, the generator runs beside the learner's resident states (rltune keeps
    them on the device while vLLM generates: no sleep mode), so their sum must fit."""
    cap = cluster.memory_gb * GB
    learner = learner_memory(spec, work, cand, cluster).total
    generator = generator_memory(spec, work, cand, cluster).total
    where = f"at {_layout_text(cand.learner)}"
    has = f"has {cluster.memory_gb:g}"
    if cand.colocate and work.generates:
        if learner + generator > cap:
            return [f"learner and generator together need {(learner + generator) / GB:.1f} GB per device {where} "
                    f"colocated (learner {learner / GB:.1f} + generator {generator / GB:.1f} at "
                    f"generator_tp={cand.generator_tp}), {has}"]
        return []
    problems = []
    if learner > cap:
        problems.append(f"learner needs {learner / GB:.1f} GB per device {where}, {has}")
    if generator > cap:
        problems.append(f"generator needs {generator / GB:.1f} GB per device at generator_tp={cand.generator_tp}, {has}")
    return problems


def min_devices_to_fit(spec: ModelSpec, work: Workload, cluster: Cluster, *, limit: int = MAX_GPUS) -> int:
    """The fewest learner devices on which the learner fits fully sharded (``dp_shard`` =
    N, tp = pp = ep = 1), every block checkpointed, one row per micro-batch, the
    parameters on the device or (N > 1, FSDP2's ``offload: params``; not on a CPU cluster
    or with LoRA) the host, whichever fits: for the message of a cluster too small at any
    layout. Found by bisection. Raises :class:`PlanError` when even ``limit`` devices
    (the most the search plans for) are not enough (what does not shard exceeds a device)."""
    cap, offload = cluster.memory_gb * GB, cluster.kind == "gpu" and work.lora_rank is None

    def bytes_at(n: int) -> float:
        return min(learner_memory(spec, work, Candidate(LearnerLayout(dp_shard=n), micro_batch_tokens=1,
                                  activation_checkpointing="full", offload=o), cluster).total for o in
                   (("none", "params") if n > 1 and offload else ("none",)))

    def fits(n: int) -> bool:
        return bytes_at(n) <= cap

    if not fits(limit):
        raise PlanError(f"{spec.name}: one learner device needs {bytes_at(limit) / GB:.1f} GB even sharded over "
                        f"{limit} devices (one row of {work.tokens_per_sample} tokens), more than the "
                        f"{cluster.memory_gb:g} GB a device has: shorten the sequences or lower "
                        "train.logprob_chunk_tokens")
    low, high = 0, 1
    while not fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high
