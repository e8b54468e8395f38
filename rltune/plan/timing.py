"""Seconds of one training step by phase, for one candidate layout: the learner's compute
(forward, backward, no-grad forwards, optimizer), its communication, generation (prefill
and decode), scoring, the weight sync, and the step's wall time once generation overlaps
learning (``max_staleness`` > 0).

Each term is ``count / eff.X`` or ``eff.Y x count``, counts from the model's shape, so that
``plan --calibrate`` can fit ``Efficiency`` by least squares. Units: seconds, FLOPs, bytes.

* a causal sequence of ``S`` tokens costs ``S * forward_flops_per_token(spec, (S + 1) / 2)``
  in its forward: token ``i`` attends to ``i`` positions, and the catalogue's FLOPs are
  affine in the context (``2 x matmul params + 4 x layers x heads x head_dim x context``);
* forward + backward = 3 forwards (Kaplan et al. 2020; Narayanan et al. 2021, eq. 3), one
  more with full activation checkpointing; LoRA skips the frozen weights' gradients
  (backward = 1 forward of activation gradients; Hu et al. 2021);
* the learner stores its parameters in ``model.dtype`` (``Workload.model_dtype``, float32
  by default) and computes under autocast (``train.precision``, ``rltune/models/autocast.py``);
  FSDP2 has no mixed-precision policy there, so its gathers and gradient reductions move
  the stored dtype (4 or 2 bytes a parameter); activations are 2 bytes (4 at fp32);
* collectives are rings at the bandwidth of the link the group spans (``rltune.plan.collectives``);
* the learner mesh is ``pp, dp_replicate, dp_shard, ep, tp`` outermost first
  (``rltune/parallel/layout.py``): a dim's stride is the product of the dims after it.
"""

from __future__ import annotations

import math

from rltune.plan import catalogue
from rltune.plan.collectives import GIGA, all_gather_s, all_reduce_s, all_to_all_s, link_bandwidth
from rltune.plan.sample_work import learner_sample_work, sequence_flops, shares_prompts
from rltune.plan.spec import Candidate, Cluster, Efficiency, ModelSpec, StepTime, Workload

TERA = 1e12
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ADAM_VALUES = 7
"""Values the optimizer step moves per trainable parameter: AdamW reads the weight, its
gradient and two moments (4) and writes the weight and the moments back (3), each in the
parameters' dtype (torch keeps the moments in it): 28 bytes at float32, 14 at bfloat16."""
SELECTIVE_EVERY = 2
"""``selective`` checkpointing recomputes every 2nd block (``train.checkpoint_every`` default)."""


# ---- rates and counts -------------------------------------------------------------------


def peak_flops(cluster: Cluster, precision: str) -> float:
    """One device's peak dense matmul FLOP/s at ``precision``: bf16/fp16 ``cluster.tflops``,
    fp32 ``tflops x fp32_ratio``, fp8 ``2 x tflops`` (H100 datasheet: 1,979 fp8 against
    989 bf16 TFLOP/s; fp8 applies to the linear layers only, see :func:`compute_seconds`)."""
    if precision not in VALUE_BYTES:
        raise ValueError(f"precision {precision!r}: expected one of {sorted(VALUE_BYTES)}")
    scale = {"fp32": cluster.fp32_ratio, "fp8": 2.0}.get(precision, 1.0)
    return cluster.tflops * TERA * scale


def compute_seconds(linear: float, attention: float, cluster: Cluster, precision: str, mfu: float) -> float:
    """Seconds of ``linear`` matmul FLOPs plus ``attention`` score/value FLOPs on one device
    at ``mfu`` of its peak. fp8 (torchao float8 training) converts ``nn.Linear`` only: the
    linears run at the fp8 peak, attention at the bf16 one."""
    if precision == "fp8":
        return (linear / peak_flops(cluster, "fp8") + attention / peak_flops(cluster, "bf16")) / mfu
    return (linear + attention) / (peak_flops(cluster, precision) * mfu)


def _layers_local(spec: ModelSpec, cand: Candidate) -> float:
    return spec.layers / cand.learner.pp


def _minibatch_rows(work: Workload, cand: Candidate) -> int:
    return math.ceil(math.ceil(work.samples_per_step / cand.learner.data_world) / work.minibatches)


def micro_batches(work: Workload, cand: Candidate) -> int:
    """Micro-batches one learner rank runs per optimizer step: its rows
    ``ceil(samples / data_world)``, cut into ``minibatches``, ``floor(micro_batch_tokens /
    tokens_per_sample)`` rows (at least one) a micro-batch."""
    per = max(1, cand.micro_batch_tokens // work.tokens_per_sample)
    return math.ceil(_minibatch_rows(work, cand) / per)


def micro_batch_tokens(work: Workload, cand: Candidate) -> float:
    """Mean tokens of one micro-batch: a mini-batch's rows x tokens per sample over its
    micro-batches (so that micro-batches x this is the rank's tokens exactly)."""
    return _minibatch_rows(work, cand) * work.tokens_per_sample / micro_batches(work, cand)


def optimizer_steps(work: Workload) -> int:
    """Optimizer steps per training step: every mini-batch of every epoch."""
    return work.epochs * work.minibatches


def _recompute(cand: Candidate) -> float:
    """Extra forwards a backward recomputes under activation checkpointing."""
    return {"none": 0.0, "full": 1.0, "selective": 1.0 / SELECTIVE_EVERY}[cand.activation_checkpointing]


def _train_passes(work: Workload, cand: Candidate) -> float:
    """Forward-equivalents of one forward + backward: 1 + 2 (1 with LoRA) + recompute."""
    return 1.0 + (1.0 if work.lora_rank else 2.0) + _recompute(cand)


def _models(work: Workload) -> int:
    """Trained models of the same size: the policy, and the critic (PPO; rltune builds it
    from the policy's architecture with a value head, assumed here of the policy's size)."""
    return 2 if work.critic else 1


def param_bytes(work: Workload) -> int:
    """Bytes of one stored learner parameter or gradient (``model.dtype``)."""
    return 4 if work.model_dtype == "float32" else 2


# ---- learner compute --------------------------------------------------------------------


def learner_forwards(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency,
                     passes: float) -> float:
    """Seconds of ``passes`` forward-equivalents over the step's batch on one learner rank:
    ``samples x sequence_flops / world`` at ``eff.train_mfu``, plus ``eff.layer_overhead_s``
    per local layer call (each micro-batch's pass calls every local layer once, twice where
    the prompts run once per group: the prompts' forward, then the completions' against
    their cache, :func:`shares_prompts`), plus ``eff.token_overhead_s`` per token per
    local layer per pass (the element-wise work that grows with the tokens)."""
    linear, attention, sample_tokens = learner_sample_work(spec, work, cand)
    scale = passes * work.samples_per_step / cand.learner.world
    flops = compute_seconds(scale * linear, scale * attention, cluster, work.precision, eff.train_mfu)
    forwards = 2 if shares_prompts(spec, work, cand) else 1
    calls = passes * forwards * micro_batches(work, cand) * work.minibatches * _layers_local(spec, cand)
    tokens = scale * sample_tokens * _layers_local(spec, cand)
    return flops + eff.layer_overhead_s * calls + eff.token_overhead_s * tokens


def forward_backward(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of the step's forwards and backwards on one learner rank: ``epochs`` passes
    of forward + backward (:func:`_train_passes`) for each trained model (policy, critic)."""
    passes = _train_passes(work, cand) * work.epochs * _models(work)
    return learner_forwards(spec, work, cand, cluster, eff, passes)


def no_grad_forwards(work: Workload) -> int:
    """No-gradient forwards over the step's batch (``rltune/runtime/experience.py``):
    old log-probs only when the batch is learned more than once (epochs x minibatches > 1;
    otherwise the loss detaches the current ones; with ``max_staleness`` > 0 the
    generator's log-probs serve the importance correction, no forward either); the
    reference's when an online algorithm has one (DPO's are computed once per run and
    cached, ``rltune/learner/preference.py``: 0 per step); the critic's values (PPO)."""
    old = 1 if optimizer_steps(work) > 1 else 0
    ref = 1 if work.reference and work.generates else 0
    return old + ref + (1 if work.critic else 0)


def activation_passes(work: Workload, cand: Candidate) -> float:
    """Passes over the batch whose layers exchange activations (TP all-reduces, EP
    all-to-alls): every training forward, backward and recomputed forward (x epochs, x
    trained models) and every no-gradient forward."""
    return (2.0 + _recompute(cand)) * work.epochs * _models(work) + no_grad_forwards(work)


def param_gathers(work: Workload, cand: Candidate) -> float:
    """Parameter gathers (of the policy's size) per step under FSDP: each micro-batch's
    forward and backward gather every layer, a no-gradient forward once, and the gradients
    are reduce-scattered once per optimizer step (rltune accumulates without sync,
    ``rltune/learner/parallel.py``)."""
    m = micro_batches(work, cand)
    return (2 * m + 1) * optimizer_steps(work) * _models(work) + no_grad_forwards(work) * m * work.minibatches


def reference(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of the no-gradient forwards (:func:`no_grad_forwards`) on one learner rank."""
    return learner_forwards(spec, work, cand, cluster, eff, float(no_grad_forwards(work)))


def local_trainable_params(spec: ModelSpec, work: Workload, cand: Candidate) -> float:
    """Trainable parameters one learner rank updates, over ``tp x pp x dp_shard x ep`` (FSDP
    shards dense weights over ``dp_shard x ep``; experts are split over ``ep``, then sharded
    over ``dp_shard``); with LoRA ``rank x (in + out)`` of the seven projections a layer."""
    lay = cand.learner
    total = catalogue.param_count(spec)
    if work.lora_rank:
        attn = 2 * spec.hidden + 2 * (spec.hidden + spec.kv_heads * spec.head_dim) + 2 * spec.heads * spec.head_dim
        total = work.lora_rank * (attn + 3 * (spec.hidden + spec.intermediate)) * spec.layers
    return total / (lay.tp * lay.pp * lay.dp_shard * lay.ep)


def optimizer(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of the optimizer steps: a memory-bound pass of ``ADAM_VALUES`` values per local
    trainable parameter at ``cluster.hbm_gbps`` (on the host, at ``cluster.host_gbps``,
    with ``offload: optimizer|params``: a CPU AdamW is bound by host memory, approximated by
    the host link's rate), per optimizer step and trained model, plus ``eff.step_overhead_s``."""
    gbps = cluster.hbm_gbps if cand.offload == "none" else cluster.host_gbps
    values = ADAM_VALUES * local_trainable_params(spec, work, cand) * optimizer_steps(work) * _models(work)
    return values * param_bytes(work) / (gbps * GIGA) + eff.step_overhead_s


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


# ---- learner communication --------------------------------------------------------------


def fsdp_comm(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of FSDP (ZeRO-3) traffic, before overlap: each local layer's stored params
    all-gathered over ``dp_shard x ep`` ranks (stride ``tp``) in every forward and again in
    every backward of every micro-batch (once in a no-gradient forward), and the gradients
    reduce-scattered once per optimizer step: ``param_gathers x all_gather(bytes x params /
    (tp pp))``, one collective per layer for the latency. Routed experts: split over ``ep``, then sharded
    over ``dp_shard`` (``rltune/parallel/strategy.py``)."""
    lay = cand.learner
    n = lay.dp_shard * lay.ep
    if n <= 1:
        return 0.0
    experts = catalogue.expert_params(spec)
    dense = param_bytes(work) * (catalogue.param_count(spec) - experts) / (lay.tp * lay.pp)
    # experts are split over ep first, then sharded over dp_shard only (stride tp x ep)
    routed = param_bytes(work) * experts / (lay.ep * lay.tp * lay.pp)
    one = (all_gather_s(dense, n, link_bandwidth(cluster, n, lay.tp, eff), 0.0)
           + all_gather_s(routed, lay.dp_shard, link_bandwidth(cluster, lay.dp_shard, lay.tp * lay.ep, eff), 0.0)
           + _layers_local(spec, cand) * (n - 1) * eff.comm_latency_s)
    return param_gathers(work, cand) * one


def fsdp_exposed(comm: float, compute: float, layers: float) -> float:
    """FSDP traffic not hidden behind compute. FSDP2 prefetches the next layer's gather
    while a layer computes (torchtitan's default), so all but the first layer's share
    hides, as long as the compute lasts: ``max(0, comm - compute) + comm / layers``."""
    return max(0.0, comm - compute) + comm / layers if comm > 0 else 0.0


def dp_comm(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of the gradient all-reduce over ``dp_replicate`` replicas (DDP, or HSDP of
    each shard), once per optimizer step: ``all_reduce(bytes x local params)``, not overlapped
    (conservative: DDP's buckets overlap it with the last backward)."""
    lay = cand.learner
    stride = lay.dp_shard * lay.ep * lay.tp
    bw = link_bandwidth(cluster, lay.dp_replicate, stride, eff)
    nbytes = param_bytes(work) * local_trainable_params(spec, work, cand)
    return _models(work) * optimizer_steps(work) * all_reduce_s(nbytes, lay.dp_replicate, bw, eff.comm_latency_s)


def tp_comm(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of tensor-parallel all-reduces (Megatron-LM, Shoeybi et al. 2019): two per
    layer (attention, MLP) in every forward, backward and recomputed forward
    (:func:`activation_passes`), of ``micro-batch tokens x hidden`` activations, not overlapped."""
    lay = cand.learner
    if lay.tp <= 1:
        return 0.0
    bw = link_bandwidth(cluster, lay.tp, 1, eff)
    nbytes = micro_batch_tokens(work, cand) * spec.hidden * _act_bytes(work.precision)
    calls = 2 * activation_passes(work, cand) * _layers_local(spec, cand) * micro_batches(work, cand) * work.minibatches
    return calls * all_reduce_s(nbytes, lay.tp, bw, eff.comm_latency_s)


def ep_comm(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of expert-parallel all-to-alls: dispatch and combine per MoE layer in every
    forward, backward and recomputed forward (:func:`activation_passes`), of ``tokens x
    experts_per_token x hidden`` activations over ``ep`` ranks (stride ``tp``)."""
    lay = cand.learner
    if lay.ep <= 1 or not spec.is_moe:
        return 0.0
    bw = link_bandwidth(cluster, lay.ep, lay.tp, eff)
    nbytes = micro_batch_tokens(work, cand) * spec.experts_per_token * spec.hidden * _act_bytes(work.precision)
    moe_layers = catalogue.sparse_in(spec, 0, spec.layers) / lay.pp
    calls = 2 * activation_passes(work, cand) * moe_layers * micro_batches(work, cand) * work.minibatches
    return calls * all_to_all_s(nbytes, lay.ep, bw, eff.comm_latency_s)


def pp_bubble(compute: float, work: Workload, cand: Candidate) -> float:
    """Idle pipeline time: GPipe and 1F1B both leave a bubble of ``(p-1)/m`` of the ideal
    time with ``m`` micro-batches per optimizer step (Narayanan et al. 2021, sec. 2.2:
    bubble fraction ``(p-1)/(m+p-1)`` of the whole); ``compute`` is the stage's busy time."""
    p = cand.learner.pp
    return 0.0 if p <= 1 else compute * (p - 1) / micro_batches(work, cand)


def pp_sends(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Point-to-point sends between stages: each micro-batch's activations in every forward
    and their gradients in every backward, ``tokens x hidden`` each, over the link between
    stages (stride ``world / pp``), not overlapped."""
    lay = cand.learner
    if lay.pp <= 1:
        return 0.0
    bw = link_bandwidth(cluster, 2, lay.world // lay.pp, eff)
    one = micro_batch_tokens(work, cand) * spec.hidden * _act_bytes(work.precision) / bw + eff.comm_latency_s
    passes = 2 * work.epochs * _models(work) + no_grad_forwards(work)
    return passes * micro_batches(work, cand) * work.minibatches * one


def offload_comm(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Device-host copies of offload at ``cluster.host_gbps``, not overlapped: ``optimizer``
    sends the gradients down and the weights up once per optimizer step (2 values a local
    parameter); ``params`` also brings each shard up for every :func:`param_gathers`."""
    if cand.offload == "none":
        return 0.0
    copies = 2 * optimizer_steps(work) * _models(work)
    if cand.offload == "params":
        copies += param_gathers(work, cand)
    return copies * param_bytes(work) * local_trainable_params(spec, work, cand) / (cluster.host_gbps * GIGA)


def learner_comm(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency,
                 compute: float) -> dict[str, float]:
    """Exposed communication of the learner by kind (``StepTime.comm``); ``compute`` is the
    seconds of the forwards and backwards that FSDP's gathers hide behind."""
    comm = {"fsdp": fsdp_exposed(fsdp_comm(spec, work, cand, cluster, eff), compute, _layers_local(spec, cand)),
            "dp": dp_comm(spec, work, cand, cluster, eff), "tp": tp_comm(spec, work, cand, cluster, eff),
            "ep": ep_comm(spec, work, cand, cluster, eff), "offload": offload_comm(spec, work, cand, cluster, eff)}
    busy = compute + comm["tp"] + comm["ep"]
    comm["pp_bubble"] = pp_bubble(busy, work, cand) + pp_sends(spec, work, cand, cluster, eff)
    return {k: v for k, v in comm.items() if v > 0}


# ---- generation -------------------------------------------------------------------------


def sum_max_affine(a1: float, b1: float, a2: float, b2: float, n: int) -> float:
    """``sum_{t=1..n} max(a1 + b1 t, a2 + b2 t)`` in closed form: the two lines cross once
    at most, so the sum splits at the crossing into two arithmetic series."""

    def series(a: float, b: float, lo: int, hi: int) -> float:
        count = hi - lo + 1
        return 0.0 if count <= 0 else count * a + b * (lo + hi) * count / 2

    if b1 == b2:
        return series(max(a1, a2), b1, 1, n)
    cross = (a2 - a1) / (b1 - b2)  # line 1 is above line 2 for t > cross when b1 > b2
    k = min(n, max(0, math.floor(cross)))
    low, high = ((a2, b2), (a1, b1)) if b1 > b2 else ((a1, b1), (a2, b2))
    return series(*low, 1, k) + series(*high, k + 1, n)


def decode_weight_bytes(spec: ModelSpec, batch: int, precision: str) -> float:
    """Weight bytes one decode step reads: every weight but the input embedding (a lookup
    of ``batch`` rows), and of the routed experts the expected share that ``batch`` tokens
    touch, ``1 - (1 - k/E)^batch`` under uniform routing."""
    experts = catalogue.expert_params(spec)
    dense = catalogue.param_count(spec) - experts - (0 if spec.tied_embeddings else spec.vocab * spec.hidden)
    touched = 1 - (1 - spec.experts_per_token / spec.experts) ** batch if spec.is_moe else 0.0
    return (dense + experts * touched) * VALUE_BYTES[precision]


def generator_batch(work: Workload, cand: Candidate) -> tuple[int, int]:
    """``(prompts, sequences)`` one generator replica holds: whole groups, split evenly."""
    prompts = math.ceil(work.prompts_per_step / cand.generator_replicas)
    return prompts, prompts * work.group_size


def generator_tp_comm(spec: ModelSpec, tokens: int, cand: Candidate, cluster: Cluster, eff: Efficiency,
                      precision: str) -> float:
    """Seconds of one forward's TP all-reduces in a generator: two per layer (attention,
    MLP) of ``tokens x hidden`` activations over ``generator_tp`` ranks."""
    tp = cand.generator_tp
    bw = link_bandwidth(cluster, tp, 1, eff)
    return 2 * spec.layers * all_reduce_s(tokens * spec.hidden * VALUE_BYTES[precision], tp, bw, eff.comm_latency_s)


def prefill(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of one replica's prefill, compute-bound: each prompt once (a group's samples
    share its prefill), ``prompts x sequence_flops(P) / generator_tp`` at
    ``eff.prefill_mfu``, plus one forward's layer overheads, its per-token overheads and
    TP all-reduces."""
    if not work.generates:
        return 0.0
    prompts, _ = generator_batch(work, cand)
    linear, attention = sequence_flops(spec, work.prompt_tokens)
    scale = prompts / cand.generator_tp
    flops = compute_seconds(scale * linear, scale * attention, cluster, work.rollout_precision, eff.prefill_mfu)
    comm = generator_tp_comm(spec, prompts * work.prompt_tokens, cand, cluster, eff, work.rollout_precision)
    per_token = eff.token_overhead_s * prompts * work.prompt_tokens * spec.layers / cand.generator_tp
    return flops + spec.layers * eff.layer_overhead_s + per_token + comm


def decode(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds of one replica's decode of ``completion_tokens`` tokens for its ``B``
    sequences, all reaching the maximum length (the planner's worst case; the simulation
    models the spread). Token ``t`` (context ``c = P + t``) takes

        max(bytes_t / (hbm x eff.decode_bandwidth), B x F(c) / tp / (peak x eff.decode_mfu))
        + layers x (eff.layer_overhead_s + B x eff.token_overhead_s / tp)
        + 2 x layers TP all-reduces of B x hidden,

    ``bytes_t = weights / tp + B x kv_bytes_per_token x c / min(tp, kv_heads)`` (the KV
    heads split over TP). Both sides are affine in ``t``: summed in closed form."""
    if not work.generates:
        return 0.0
    _, batch = generator_batch(work, cand)
    tp, p, prec = cand.generator_tp, work.prompt_tokens, work.rollout_precision
    mem_rate = cluster.hbm_gbps * GIGA * eff.decode_bandwidth
    kv = batch * catalogue.kv_bytes_per_token(spec, VALUE_BYTES[prec]) / min(tp, spec.kv_heads) / mem_rate
    weights = decode_weight_bytes(spec, batch, prec) / tp / mem_rate
    cmp_rate = peak_flops(cluster, prec) * eff.decode_mfu * tp
    f0 = catalogue.forward_flops_per_token(spec, 0)
    f1 = catalogue.forward_flops_per_token(spec, 1) - f0  # FLOPs per token of context
    mem = (weights + kv * p, kv)
    flops = (batch * (f0 + f1 * p) / cmp_rate, batch * f1 / cmp_rate)
    fixed = spec.layers * (eff.layer_overhead_s + batch * eff.token_overhead_s / tp) \
        + generator_tp_comm(spec, batch, cand, cluster, eff, prec)
    return sum_max_affine(*mem, *flops, work.completion_tokens) + work.completion_tokens * fixed


def score(work: Workload, eff: Efficiency) -> float:
    """Seconds of scoring: ``eff.score_s`` per sample (the wall time per sample of the
    run's reward workers together), not overlapped with generation."""
    return eff.score_s * work.samples_per_step if work.generates else 0.0


# ---- weight sync ------------------------------------------------------------------------


def _remote_generator_nodes(cand: Candidate, cluster: Cluster) -> int:
    """Nodes holding generators other than node 0 (learner rank 0's); the generators take
    the devices after the learners'."""
    first = max(cand.learner_gpus // cluster.gpus_per_node, 1)
    last = (cand.gpus - 1) // cluster.gpus_per_node
    return max(0, last - first + 1)


def weight_sync(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds to bring the learner's weights to the generators, at rollout precision
    (``bytes = params x bytes per value``), after the learner gathers its shards
    (``full_state_dict``: an all-gather of the stored params over ``dp_shard x ep``):

    * colocated: a copy in device memory, read and write at HBM speed, ``2 x bytes / tp / hbm``;
    * ``broadcast`` (``runtime.weight_sync``, ``rltune/runtime/ray/sync.py``): a pipelined
      broadcast from learner rank 0 over the slowest link between the groups (inter-node
      when the layout spans nodes), ``bytes / bw + replicas x latency``;
    * ``object_store``: rank 0 copies to host memory once, each other node fetches once over
      rank 0's link (one after the other), each replica copies to its device:
      ``2 x bytes / host + remote nodes x bytes / inter``."""
    if not work.generates:
        return 0.0
    lay = cand.learner
    nbytes = catalogue.param_count(spec) * VALUE_BYTES[work.rollout_precision]
    n = lay.dp_shard * lay.ep
    gather = all_gather_s(param_bytes(work) * catalogue.param_count(spec) / (lay.tp * lay.pp), n,
                          link_bandwidth(cluster, n, lay.tp, eff), eff.comm_latency_s)
    if cand.colocate:
        return gather + 2 * nbytes / cand.generator_tp / (cluster.hbm_gbps * GIGA)
    if cand.weight_sync == "broadcast":
        bw = link_bandwidth(cluster, cand.gpus, 1, eff)
        return gather + nbytes / bw + cand.generator_replicas * eff.comm_latency_s
    remote = _remote_generator_nodes(cand, cluster) * nbytes / (cluster.inter_gbps * GIGA * eff.comm_bandwidth)
    return gather + 2 * nbytes / (cluster.host_gbps * GIGA) + remote


# ---- the step ---------------------------------------------------------------------------


def overlapped_step(generate: float, scoring: float, learn: float, sync: float, cand: Candidate) -> float:
    """Wall seconds of a step from its phases.

    * ``max_staleness`` = 0, or colocated (one device does both): in turn,
      ``generate + score + learn + sync``;
    * ``max_staleness`` = k >= 1 on separate devices: the next batch is generated while the
      learner learns, a steady-state two-stage pipeline, ``max(generate + score, learn) +
      sync``, the sync on both paths: the producer loads weights only between batches and
      the learner's next take waits until it has (``rltune/runtime/rollouts.py``). This is
      the one-step-off-policy schedule of verl and the asynchronous ones of AReaL (Fu et
      al. 2025) and PipelineRL (Piche et al. 2025) at their mean; k > 1 adds slack that
      absorbs the spread of generation times (``rltune.plan.simulate``), not mean speed."""
    if cand.max_staleness == 0 or cand.colocate:
        return generate + scoring + learn + sync
    return max(generate + scoring, learn) + sync


def step_time(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency) -> StepTime:
    """Seconds of one training step by phase, and ``step``, its wall time after overlap."""
    fb, ref = forward_backward(spec, work, cand, cluster, eff), reference(spec, work, cand, cluster, eff)
    t = StepTime(
        prefill=prefill(spec, work, cand, cluster, eff), decode=decode(spec, work, cand, cluster, eff),
        score=score(work, eff), reference=ref, forward_backward=fb,
        optimizer=optimizer(spec, work, cand, cluster, eff),
        comm=learner_comm(spec, work, cand, cluster, eff, fb + ref),
        weight_sync=weight_sync(spec, work, cand, cluster, eff),
    )
    step = overlapped_step(t.generate, t.score, t.learn, t.weight_sync, cand)
    return StepTime(**{**t.__dict__, "step": step})


def samples_per_second(work: Workload, t: StepTime) -> float:
    """Samples trained per second: ``samples_per_step / step``."""
    return work.samples_per_step / t.step


def utilisation(t: StepTime) -> dict[str, float]:
    """Busy share of each role's devices over a step (``Plan.utilisation``): generators
    ``(generate + weight_sync) / step``, learners ``(learn + weight_sync) / step`` (both
    sides take part in the sync, :func:`overlapped_step`); at most 1 by that rule."""
    return {"generator": (t.generate + t.weight_sync) / t.step, "learner": (t.learn + t.weight_sync) / t.step}
