"""The pipeline simulation (:mod:`rltune.plan.simulate`) of one layout: ``gpus`` devices
split between generator replicas and a learner group, the simulation's plain numbers filled
from the cost model (``rltune.plan.timing`` for decode, prefill, the learner's step and the
weight sync; ``rltune.plan.memory`` for what fits).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from rltune.plan import catalogue, timing
from rltune.plan.errors import PlanError
from rltune.plan.memory import learner_memory
from rltune.plan.simulate import Lengths, LognormalLengths, Pipeline, SimResult, simulate
from rltune.plan.spec import Candidate, Cluster, Efficiency, LearnerLayout, ModelSpec, Workload

KV_SHARE = 0.9
"""Share of a generator device for weights and KV cache (vLLM's ``gpu_memory_utilization``
default)."""
MAX_SEQS = 256
"""Most sequences a replica runs at once (vLLM's ``max_num_seqs`` default)."""


@dataclass(frozen=True)
class LayoutSimulation:
    """One split of the devices, the pipeline the cost model gives it, and its simulation."""

    candidate: Candidate
    pipeline: Pipeline
    result: SimResult
    problems: tuple[str, ...]
    """Whether the learner fits (``rltune.plan.memory.learner_memory`` at the completion
    limit); empty: fits. The generators fit by construction: their slots are what the KV
    cache leaves room for (:func:`pipeline_for`), where ``memory.generator_memory`` holds a
    replica's whole share at once."""


def split_devices(gpus: int, generator_share: float, generator_tp: int, gpus_per_node: int) -> tuple[int, LearnerLayout]:
    """``(generator replicas, learner layout)`` for ``generator_share`` of ``gpus`` generating
    (rounded to whole replicas of ``generator_tp``): the learners shard within a node
    (FSDP, ``dp_shard`` = the node's learners) and replicate across nodes (HSDP), so a
    learner count above a node must fill whole nodes."""
    replicas = max(1, round(gpus * generator_share / generator_tp))
    learners = gpus - replicas * generator_tp
    if learners < 1:
        raise PlanError(f"simulate: generator_share={generator_share} of {gpus} devices leaves no learner")
    if learners <= gpus_per_node:
        return replicas, LearnerLayout(dp_shard=learners)
    if learners % gpus_per_node:
        raise PlanError(f"simulate: {learners} learner devices do not fill whole nodes of {gpus_per_node}; "
                        f"choose a generator_share that leaves a multiple of {gpus_per_node}")
    return replicas, LearnerLayout(dp_shard=gpus_per_node, dp_replicate=learners // gpus_per_node)


def mean_length(lengths: Lengths, seed: int = 0, n: int = 20_000) -> float:
    """Mean completion length of ``lengths``, over ``n`` draws."""
    rng = random.Random(seed)
    return sum(lengths.draw(rng, i) for i in range(n)) / n


def pipeline_for(spec: ModelSpec, work: Workload, cand: Candidate, cluster: Cluster, eff: Efficiency,
                 lengths: Lengths, *, batching: str = "static") -> Pipeline:
    """The simulation's inputs for ``cand`` from ``rltune.plan.timing``: a decode step's
    roofline (the weights ``decode_weight_bytes / tp`` and TP all-reduces per step; the KV
    cache of a token at the mean context ``P + E[L]/2`` per sequence at ``hbm x
    eff.decode_bandwidth``; or its ``forward_flops_per_token`` at ``eff.decode_mfu``),
    the prompt's prefill shared by its group, ``step_time``'s learner phases and weight
    sync at the mean completion length ``E[L]`` (the sync on both sides, ``load_s`` =
    ``sync_s``, as ``timing.overlapped_step`` has it), and as many slots as the KV cache
    of sequences of ``P + E[L]`` tokens leaves room for in ``KV_SHARE`` of the device
    (paged: a sequence holds what it has written), at most ``MAX_SEQS``."""
    tp, prec, p_tok = cand.generator_tp, work.rollout_precision, work.prompt_tokens
    e_len = mean_length(lengths)
    mem_rate = cluster.hbm_gbps * 1e9 * eff.decode_bandwidth
    kv_token = catalogue.kv_bytes_per_token(spec, timing.VALUE_BYTES[prec]) / min(tp, spec.kv_heads)
    room = cluster.memory_gb * 1e9 * KV_SHARE - catalogue.param_count(spec) * timing.VALUE_BYTES[prec] / tp
    slots = min(MAX_SEQS, math.floor(room / (kv_token * (p_tok + e_len))))
    if slots < 1:
        raise PlanError(f"simulate: {spec.name} at generator_tp={tp} leaves no room for a sequence's KV cache "
                        f"on a {cluster.memory_gb:g} GB device")
    context = p_tok + e_len / 2
    linear, attention = timing.sequence_flops(spec, p_tok)
    prompt_s = timing.compute_seconds(linear / tp, attention / tp, cluster, prec, eff.prefill_mfu)
    t = timing.step_time(spec, replace(work, completion_tokens=round(e_len)), cand, cluster, eff)
    return Pipeline(
        batch=work.samples_per_step, generators=cand.generator_replicas, slots=slots,
        per_step_s=timing.decode_weight_bytes(spec, slots, prec) / tp / mem_rate + spec.layers * eff.layer_overhead_s
        + timing.generator_tp_comm(spec, slots, cand, cluster, eff, prec),
        per_sequence_s=kv_token * context / mem_rate,
        compute_per_sequence_s=catalogue.forward_flops_per_token(spec, context)
        / (timing.peak_flops(cluster, prec) * eff.decode_mfu * tp),
        prefill_s=prompt_s / work.group_size, learn_s=t.learn, sync_s=t.weight_sync, load_s=t.weight_sync,
        max_staleness=cand.max_staleness, lengths=lengths, batching=batching)  # type: ignore[arg-type]


def simulate_layout(spec: ModelSpec, work: Workload, cluster: Cluster, eff: Efficiency, gpus: int,
                    generator_share: float, staleness: int, *, lengths: Lengths | None = None,
                    generator_tp: int = 1, batching: str = "static", steps: int = 24, warmup: int = 4,
                    seed: int = 0, **candidate: object) -> LayoutSimulation:
    """Simulate ``generator_share`` of ``gpus`` devices generating and the rest learning
    (:func:`split_devices`), generating ``staleness`` steps ahead. ``lengths`` defaults to
    :class:`LognormalLengths` with the median at an eighth of the completion limit and
    ``sigma`` 0.99; ``candidate`` sets further :class:`Candidate` fields (checkpointing,
    weight sync, micro-batch tokens)."""
    replicas, learner = split_devices(gpus, generator_share, generator_tp, cluster.gpus_per_node)
    cand = Candidate(learner=learner, generator_tp=generator_tp, generator_replicas=replicas,
                     max_staleness=staleness, **candidate)  # type: ignore[arg-type]
    lengths = lengths or LognormalLengths(work.completion_tokens / 8, 0.99, work.completion_tokens)
    pipe = pipeline_for(spec, work, cand, replace(cluster, gpus=gpus), eff, lengths, batching=batching)
    need = learner_memory(spec, work, cand, replace(cluster, gpus=gpus)).total / 1e9
    problems = (f"learner needs {need:.1f} GB per device at dp_shard={learner.dp_shard} "
                f"dp_replicate={learner.dp_replicate}, has {cluster.memory_gb:g}",) if need > cluster.memory_gb else ()
    return LayoutSimulation(cand, pipe, simulate(pipe, steps=steps, warmup=warmup, seed=seed), problems)
