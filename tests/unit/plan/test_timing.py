"""The time cost model (``rltune.plan.timing``) against hand-worked values.

The model's shape enters through ``rltune.plan.catalogue``; most tests replace its
functions with round numbers (``fake_catalogue``) so that each expected value can be
worked by hand beside it:

* forward FLOPs per token ``F(c) = 2e9 + 4e4 x c`` (a 1e9-matmul-parameter model),
* ``param_count = 1e9``, ``expert_params = 0`` (``4e8`` for the MoE tests),
* KV bytes per token ``1e5 x bytes_per_value``;

a cluster of round rates (100 TFLOP/s, 1,000 GB/s HBM, 100 GB/s in a node of 4, 10 GB/s
between nodes, 10 GB/s to the host) and round efficiencies (all 0.5; 1 ms a layer call,
0.1 s a step, 10 us a hop). The ``test_scale_*`` tests use the real catalogue.
"""

from __future__ import annotations

import math

import pytest

from rltune.plan import catalogue, timing
from rltune.plan.spec import Candidate, Cluster, Efficiency, LearnerLayout, ModelSpec, Workload

SPEC = ModelSpec(name="hand", hidden=1000, layers=10, heads=8, kv_heads=8, head_dim=125, intermediate=4000,
                 vocab=1000)
MOE = ModelSpec(name="hand-moe", hidden=1000, layers=10, heads=8, kv_heads=8, head_dim=125, intermediate=4000,
                vocab=1000, experts=4, experts_per_token=2, expert_intermediate=1000)
CLUSTER = Cluster(gpus=8, gpus_per_node=4, tflops=100.0, hbm_gbps=1000.0, intra_gbps=100.0, inter_gbps=10.0,
                  host_gbps=10.0, fp32_ratio=0.5)
EFF = Efficiency(train_mfu=0.5, prefill_mfu=0.5, decode_bandwidth=0.5, decode_mfu=0.5, layer_overhead_s=1e-3,
                 step_overhead_s=0.1, comm_bandwidth=0.5, comm_latency_s=1e-5, score_s=0.01)
# 4 prompts x 2 samples = 8 sequences of 100 + 100 tokens
WORK = Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=4, group_size=2,
                prompt_tokens=100, completion_tokens=100)


@pytest.fixture(autouse=True)
def fake_catalogue(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    if request.function.__name__.startswith("test_scale_"):
        return  # the real catalogue
    monkeypatch.setattr(catalogue, "forward_flops_per_token", lambda spec, context: 2e9 + 4e4 * context)
    monkeypatch.setattr(catalogue, "param_count", lambda spec: 1e9)
    monkeypatch.setattr(catalogue, "expert_params", lambda spec: 4e8 if spec.is_moe else 0)
    monkeypatch.setattr(catalogue, "kv_bytes_per_token", lambda spec, b: 1e5 * b)


def cand(**kw) -> Candidate:
    layout = {k: kw.pop(k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep") if k in kw}
    return Candidate(learner=LearnerLayout(**layout), **({"micro_batch_tokens": 400} | kw))


def test_peak_flops_by_precision() -> None:
    assert timing.peak_flops(CLUSTER, "bf16") == 100e12
    assert timing.peak_flops(CLUSTER, "fp32") == 50e12  # 100 x fp32_ratio 0.5
    assert timing.peak_flops(CLUSTER, "fp8") == 200e12  # twice 16-bit
    with pytest.raises(ValueError, match="precision 'int4'"):
        timing.peak_flops(CLUSTER, "int4")


def test_fp8_speeds_up_the_linears_only() -> None:
    # 2e14 linear FLOPs at 2e14/s + 1e14 attention FLOPs at 1e14/s = 2 s, / mfu 0.5 = 4 s
    assert timing.compute_seconds(2e14, 1e14, CLUSTER, "fp8", 0.5) == pytest.approx(4.0, rel=1e-12)
    # bf16: 3e14 / 1e14 / 0.5 = 6 s
    assert timing.compute_seconds(2e14, 1e14, CLUSTER, "bf16", 0.5) == pytest.approx(6.0, rel=1e-12)


def test_sequence_flops_sum_the_causal_contexts() -> None:
    # tokens 1..3 attend to 1, 2, 3 keys: 3 x 2e9 matmul, 4e4 x (1+2+3) = 2.4e5 attention
    assert timing.sequence_flops(SPEC, 3) == pytest.approx((6e9, 2.4e5), rel=1e-12)


def test_micro_batches_count_rows_per_rank() -> None:
    # 1024 samples / 4 ranks = 256 rows, / 2 minibatches = 128; 16384 // 1536 = 10 rows a
    # micro-batch -> ceil(12.8) = 13
    work = Workload(**(WORK.__dict__ | dict(prompts_per_step=128, group_size=8, prompt_tokens=512,
                                           completion_tokens=1024, minibatches=2)))
    assert timing.micro_batches(work, cand(dp_shard=4, micro_batch_tokens=16384)) == 13
    # a sequence longer than the budget is still one row a micro-batch: 8 rows
    assert timing.micro_batches(WORK, cand(micro_batch_tokens=10)) == 8


def test_forward_backward() -> None:
    # dp_shard 2: 4 rows per rank, 2 rows (400 tokens) a micro-batch -> m = 2.
    # one sequence of 200: matmul 200 x 2e9 = 4e11, attention 200 x 4e4 x 100.5 = 8.04e8;
    # 3 passes x 8 samples / 2 ranks = 12 -> 12 x 4.00804e11 = 4.809648e12 FLOPs
    # / (1e14 x 0.5) = 0.09619296 s; layer calls 3 x 2 x 10 = 60 x 1 ms = 0.06 s
    assert timing.forward_backward(SPEC, WORK, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.15619296, rel=1e-9)
    # full checkpointing: 4 passes -> 16 x 4.00804e11 / 5e13 = 0.12825728 + 80 ms
    full = cand(dp_shard=2, activation_checkpointing="full")
    assert timing.forward_backward(SPEC, WORK, full, CLUSTER, EFF) == pytest.approx(0.20825728, rel=1e-9)
    # LoRA: forward + activation gradients only, 2 passes -> 8 x 4.00804e11 / 5e13 + 40 ms
    lora = Workload(**(WORK.__dict__ | dict(lora_rank=8)))
    assert timing.forward_backward(SPEC, lora, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.10412864, rel=1e-9)
    # PPO: the critic doubles it, and 2 epochs double it again: 4 x 0.15619296
    ppo = Workload(**(WORK.__dict__ | dict(critic=True, epochs=2)))
    assert timing.forward_backward(SPEC, ppo, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.62477184, rel=1e-9)


def test_a_prompt_shared_by_its_group_runs_once_where_the_learner_can() -> None:
    # one process or DDP, a dense model, no checkpointing: each prompt of 100 tokens runs
    # once for its 2 rows. Per sample: the completion's 100 tokens after 100 cached keys
    # (keys 100 x 100 + 100 x 101 / 2 = 15050): matmul 2e11, attention 4e4 x 15050 = 6.02e8;
    # half the prompt: matmul 2e11 / 2 = 1e11, attention 4e4 x 5050 / 2 = 1.01e8;
    # 3e11 + 7.03e8 a sample, 150 tokens
    ddp = cand(dp_replicate=2)
    assert timing.learner_sample_work(SPEC, WORK, ddp) == pytest.approx((3e11, 7.03e8, 150.0), rel=1e-12)
    # 12 sample-passes x 3.00703e11 / 5e13 = 0.07216872 s; each pass of each of the 2
    # micro-batches calls the 10 layers twice (the prompts, then the completions against
    # their cache): 3 x 2 x 2 x 10 = 120 calls x 1 ms = 0.12 s
    assert timing.forward_backward(SPEC, WORK, ddp, CLUSTER, EFF) == pytest.approx(0.19216872, rel=1e-9)
    # the whole rows where the path does not apply: FSDP, checkpointing, an MoE, groups of one
    for spec, work, layout in [
        (SPEC, WORK, cand(dp_shard=2)), (SPEC, WORK, cand(dp_replicate=2, activation_checkpointing="full")),
        (MOE, WORK, ddp), (SPEC, Workload(**(WORK.__dict__ | dict(group_size=1, prompts_per_step=8))), ddp),
        (SPEC, WORK, cand(dp_replicate=2, tp=2)),
    ]:
        assert not timing.shares_prompts(spec, work, layout)
        assert timing.learner_sample_work(spec, work, layout) == pytest.approx((4e11, 8.04e8, 200.0), rel=1e-12)


def test_no_grad_forwards_follow_the_runtime() -> None:
    assert timing.no_grad_forwards(WORK) == 0  # learned once: the loss detaches its own log-probs
    assert timing.no_grad_forwards(Workload(**(WORK.__dict__ | dict(reference=True)))) == 1  # KL reference
    # PPO, 2 minibatches: old log-probs + critic values + reference
    ppo = Workload(**(WORK.__dict__ | dict(critic=True, reference=True, minibatches=2)))
    assert timing.no_grad_forwards(ppo) == 3
    # DPO's reference log-probs are cached once per run
    dpo = Workload(**(WORK.__dict__ | dict(algo="dpo", generates=False, reference=True)))
    assert timing.no_grad_forwards(dpo) == 0
    # one forward over the batch: 1 x 8 / 2 x 4.00804e11 / 5e13 = 0.03206432 + 1 x 2 x 10 ms
    ref = Workload(**(WORK.__dict__ | dict(reference=True)))
    assert timing.reference(SPEC, ref, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.05206432, rel=1e-9)


def test_optimizer_is_a_memory_bound_pass() -> None:
    # 1e9 / 2 shards = 5e8 params x 28 bytes = 1.4e10 / 1e12 B/s = 0.014 s + 0.1 s step overhead
    assert timing.optimizer(SPEC, WORK, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.114, rel=1e-12)
    # offloaded: at the host rate 1e10 B/s -> 1.4 + 0.1
    off = cand(dp_shard=2, offload="optimizer")
    assert timing.optimizer(SPEC, WORK, off, CLUSTER, EFF) == pytest.approx(1.5, rel=1e-12)


def test_bfloat16_parameters_halve_the_optimizer_and_fsdp_bytes() -> None:
    work = Workload(**(WORK.__dict__ | dict(model_dtype="bfloat16")))
    # 5e8 local params x 7 values x 2 bytes = 7e9 / 1e12 = 0.007 s + 0.1 s
    assert timing.optimizer(SPEC, work, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.107, rel=1e-12)
    # gathers of 2e9 bytes: 1/2 x 2e9 / 5e10 = 0.02 + 1e-4 latency, x 5 collectives
    assert timing.fsdp_comm(SPEC, work, cand(dp_shard=2), CLUSTER, EFF) == pytest.approx(0.1005, rel=1e-12)


def test_collectives() -> None:
    # ring all-reduce of 1e9 bytes over 4 at 1e10 B/s: 2 x 3/4 x 0.1 = 0.15 + 6 hops x 1 us
    assert timing.all_reduce_s(1e9, 4, 1e10, 1e-6) == pytest.approx(0.150006, rel=1e-12)
    assert timing.all_gather_s(1e9, 4, 1e10, 1e-6) == pytest.approx(0.075003, rel=1e-12)
    assert timing.all_to_all_s(1e9, 4, 1e10, 1e-6) == pytest.approx(0.075003, rel=1e-12)
    assert timing.all_reduce_s(1e9, 1, 1e10, 1e-6) == 0.0
    # 2 ranks of stride 2 fit a node of 4: 100 GB/s x 0.5; 3 ranks of stride 2 do not: 10 x 0.5
    assert timing.link_bandwidth(CLUSTER, 2, 2, EFF) == 5e10
    assert timing.link_bandwidth(CLUSTER, 3, 2, EFF) == 5e9


def test_fsdp_traffic_and_overlap() -> None:
    # dp_shard 2 in a node: 5e10 B/s. gather of 4e9 bytes: 1/2 x 4e9 / 5e10 = 0.04 s + 10
    # layers x 1 hop x 10 us = 0.0401; m = 2 -> 2 x 2 + 1 = 5 collectives -> 0.2005
    comm = timing.fsdp_comm(SPEC, WORK, cand(dp_shard=2), CLUSTER, EFF)
    assert comm == pytest.approx(0.2005, rel=1e-12)
    # behind 0.15619296 s of compute: 0.2005 - 0.15619296 + first layer 0.2005 / 10
    assert timing.fsdp_exposed(comm, 0.15619296, 10) == pytest.approx(0.06435704, rel=1e-9)
    assert timing.fsdp_exposed(0.1, 1.0, 10) == pytest.approx(0.01, rel=1e-12)  # hidden but the first layer


def test_dp_tp_ep_pp_terms() -> None:
    # dp_replicate 2 x dp_shard 2: local 5e8 params x 4 = 2e9 bytes, stride 2 x 2 = 4 in a
    # node: 2 x 1/2 x 2e9 / 5e10 = 0.04 + 2 hops x 10 us
    assert timing.dp_comm(SPEC, WORK, cand(dp_replicate=2, dp_shard=2), CLUSTER, EFF) == pytest.approx(0.04002)
    # tp 2: 400 tokens x 1000 x 2 bytes = 8e5 bytes; all-reduce 8e5 / 5e10 = 1.6e-5 + 2e-5;
    # 4 per layer x 10 layers x m = 8 rows / 2 = 4 micro-batches -> 160 x 3.6e-5
    assert timing.tp_comm(SPEC, WORK, cand(tp=2), CLUSTER, EFF) == pytest.approx(5.76e-3, rel=1e-9)
    # ep 2 (MoE): 400 x 2 experts x 1000 x 2 bytes = 1.6e6; 1/2 x 1.6e6 / 5e10 = 1.6e-5 + 1e-5;
    # 4 per layer x 10 x m = 2 (4 rows per data rank) -> 80 x 2.6e-5
    assert timing.ep_comm(MOE, WORK, cand(ep=2), CLUSTER, EFF) == pytest.approx(2.08e-3, rel=1e-9)
    assert timing.ep_comm(SPEC, WORK, cand(ep=2), CLUSTER, EFF) == 0.0  # dense: nothing to dispatch
    # bubble (p-1)/m: pp 4 with m = 4 micro-batches (8 rows, 2 a micro-batch) -> 1 s x 3/4
    assert timing.pp_bubble(1.0, WORK, cand(pp=4)) == pytest.approx(0.75, rel=1e-12)
    # sends: 2 per micro-batch of 8e5 bytes, 8e5 / 5e10 + 1e-5 = 2.6e-5; 4 x 2 x 2.6e-5
    assert timing.pp_sends(SPEC, WORK, cand(pp=2), CLUSTER, EFF) == pytest.approx(2.08e-4, rel=1e-9)
    # optimizer offload: 8 bytes x 1e9 local params / 1e10 B/s = 0.8 s
    assert timing.offload_comm(SPEC, WORK, cand(offload="optimizer"), CLUSTER, EFF) == pytest.approx(0.8)


def test_passes_that_exchange_activations_or_gather_parameters() -> None:
    ref = Workload(**(WORK.__dict__ | dict(reference=True)))
    # a micro-batch holds the rows there are: 4 rows per rank of 200 tokens, room for 10 -> 800
    assert timing.micro_batch_tokens(WORK, cand(dp_shard=2, micro_batch_tokens=2000)) == 800
    # forward + backward + recompute (full) = 3 passes; or forward + backward + a reference forward
    assert timing.activation_passes(WORK, cand(activation_checkpointing="full")) == 3
    assert timing.activation_passes(ref, cand()) == 3
    # TP at 3 passes: 2 all-reduces x 3 passes x 10 layers x 4 micro-batches = 240 x 3.6e-5
    full = cand(tp=2, activation_checkpointing="full")
    assert timing.tp_comm(SPEC, WORK, full, CLUSTER, EFF) == pytest.approx(8.64e-3)
    assert timing.tp_comm(SPEC, ref, cand(tp=2), CLUSTER, EFF) == pytest.approx(8.64e-3)
    # FSDP gathers, m = 2: (2 x 2 + 1) for training + 2 for the reference forward's micro-batches
    assert timing.param_gathers(ref, cand(dp_shard=2)) == 7
    # PP sends: 2 training + 1 reference pass x 4 micro-batches x 2.6e-5
    assert timing.pp_sends(SPEC, ref, cand(pp=2), CLUSTER, EFF) == pytest.approx(3.12e-4, rel=1e-9)


def test_sum_max_affine() -> None:
    # max(10, 2t) for t = 1..10: 10 x 5 (t <= 5) + 12 + 14 + 16 + 18 + 20 = 130
    assert timing.sum_max_affine(10, 0, 0, 2, 10) == pytest.approx(130.0)
    assert timing.sum_max_affine(0, 2, 10, 0, 10) == pytest.approx(130.0)  # either order
    for a1, b1, a2, b2, n in [(3.0, 0.5, 1.0, 0.7, 40), (1.0, 1.0, 1.0, 1.0, 7), (-5.0, 2.0, 50.0, 0.1, 100)]:
        brute = sum(max(a1 + b1 * t, a2 + b2 * t) for t in range(1, n + 1))
        assert timing.sum_max_affine(a1, b1, a2, b2, n) == pytest.approx(brute, rel=1e-12)


def test_prefill_and_decode() -> None:
    # 2 replicas: 2 prompts (4 sequences) each. prefill: 2 x (100 x 2e9 + 100 x 4e4 x 50.5)
    # = 4.00404e11 / 5e13 = 8.00808e-3 s + 10 layers x 1 ms
    two = cand(generator_replicas=2)
    assert timing.prefill(SPEC, WORK, two, CLUSTER, EFF) == pytest.approx(0.01800808, rel=1e-9)
    # decode, memory-bound at every token: weights (1e9 - 1e6 embedding) x 2 bytes / 5e11
    # = 3.996e-3 s, KV 4 x 2e5 / 5e11 = 1.6e-6 s per context token; t = 1..100 at context
    # 100 + t: 100 x (3.996e-3 + 1.6e-4) + 1.6e-6 x 5050 = 0.42368; + 100 tokens x 10 ms
    # (compute is 4 x 2.004e9 / 5e13 = 1.6e-4 s, below)
    assert timing.decode(SPEC, WORK, two, CLUSTER, EFF) == pytest.approx(1.42368, rel=1e-9)
    # MoE: 4 sequences touch 1 - (1 - 2/4)^4 = 15/16 of the experts: weights 2 x (1e9 - 4e8
    # - 1e6 + 3.75e8) = 1.948e9 bytes / 5e11 = 3.896e-3 s -> 100 x 4.056e-3 + 8.08e-3 + 1
    assert timing.decode(MOE, WORK, two, CLUSTER, EFF) == pytest.approx(1.41368, rel=1e-9)
    dpo = Workload(**(WORK.__dict__ | dict(generates=False)))
    assert timing.decode(SPEC, dpo, two, CLUSTER, EFF) == 0.0


def test_generator_tp_adds_all_reduces() -> None:
    # one token of 4 sequences: 4 x 1000 x 2 bytes = 8e3; all-reduce over 2 = 8e3 / 5e10 =
    # 1.6e-7 + 2e-5; two per layer x 10 layers = 20 x 2.016e-5
    one = timing.generator_tp_comm(SPEC, 4, cand(generator_tp=2), CLUSTER, EFF, "bf16")
    assert one == pytest.approx(4.032e-4, rel=1e-9)


def test_weight_sync() -> None:
    # colocated, one learner: a 2e9-byte copy read and written at 1e12 B/s
    assert timing.weight_sync(SPEC, WORK, cand(colocate=True), CLUSTER, EFF) == pytest.approx(4e-3)
    # broadcast from one learner to 2 replicas, 3 devices in a node: 2e9 / 5e10 + 2 x 10 us
    bcast = cand(generator_replicas=2, weight_sync="broadcast")
    assert timing.weight_sync(SPEC, WORK, bcast, CLUSTER, EFF) == pytest.approx(0.04002)
    # object store, 4 learners (node 0) gathering 4e9 bytes (3/4 x 4e9 / 5e10 + 3 x 10 us =
    # 0.06003), to host and back 2 x 2e9 / 1e10 = 0.4, node 1 fetches 2e9 / 5e9 = 0.4
    store = cand(dp_shard=4, generator_replicas=2)
    assert timing.weight_sync(SPEC, WORK, store, CLUSTER, EFF) == pytest.approx(0.86003, rel=1e-12)


def test_overlap_and_step() -> None:
    sync, ahead = cand(), cand(max_staleness=1)
    assert timing.overlapped_step(10, 1, 5, 2, sync) == 18  # in turn
    assert timing.overlapped_step(10, 1, 5, 2, ahead) == 13  # max(10 + 1, 5) + 2
    assert timing.overlapped_step(10, 1, 5, 2, cand(max_staleness=1, colocate=True)) == 18
    t = timing.step_time(SPEC, WORK, cand(dp_shard=2, generator_replicas=2), CLUSTER, EFF)
    parts = t.prefill + t.decode + t.score + t.learn + t.weight_sync
    assert t.step == pytest.approx(parts, rel=1e-12)
    assert t.score == pytest.approx(0.08)  # 8 samples x 10 ms
    assert timing.samples_per_second(WORK, t) == pytest.approx(8 / t.step, rel=1e-12)
    use = timing.utilisation(t)
    assert use["generator"] == pytest.approx((t.generate + t.weight_sync) / t.step, rel=1e-12)
    assert use["learner"] == pytest.approx((t.learn + t.weight_sync) / t.step, rel=1e-12)
    t1 = timing.step_time(SPEC, WORK, cand(dp_shard=2, generator_replicas=2, max_staleness=1), CLUSTER, EFF)
    assert t1.step == pytest.approx(max(t1.generate + t1.score, t1.learn) + t1.weight_sync, rel=1e-12)
    assert t1.step < t.step


def test_a_preference_step_only_learns() -> None:
    dpo = Workload(**(WORK.__dict__ | dict(algo="dpo", generates=False, reference=True)))
    t = timing.step_time(SPEC, dpo, cand(dp_shard=2), CLUSTER, EFF)
    assert t.generate == t.score == t.weight_sync == t.reference == 0.0
    # 0.15619296 forward-backward + 0.114 optimizer + 0.06435704 exposed FSDP
    assert t.step == pytest.approx(0.3345500, rel=1e-6)


# ---- at scale, with the real catalogue ---------------------------------------------------

H100X8 = Cluster(gpus=8)
LLAMA_8B = catalogue.CATALOGUE["llama-3.1-8b"]


def _grpo_8b(completion: int) -> Workload:
    """GRPO, 128 prompts x 8 samples, 512 prompt tokens, bf16."""
    return Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=128,
                    group_size=8, prompt_tokens=512, completion_tokens=completion)


def _generation_share(t) -> float:
    return t.generate / (t.generate + t.score + t.learn + t.weight_sync)


def test_scale_generation_share_of_a_sync_step() -> None:
    """Llama-3.1-8B GRPO on 8 H100, colocated and in turn: the figures of the docs (every
    completion at its maximum length, default efficiencies)."""
    colocated = Candidate(LearnerLayout(dp_shard=8), generator_replicas=8, colocate=True, micro_batch_tokens=16384)
    shares = {c: _generation_share(timing.step_time(LLAMA_8B, _grpo_8b(c), colocated, H100X8, Efficiency()))
              for c in (1024, 2048, 4096)}
    assert shares[1024] == pytest.approx(0.42, abs=0.01)
    assert shares[2048] == pytest.approx(0.52, abs=0.01)
    assert shares[4096] == pytest.approx(0.62, abs=0.01)  # long completions: generation dominates


def test_scale_staleness_overlaps_generation_with_learning() -> None:
    split = dict(learner=LearnerLayout(dp_shard=4), generator_replicas=4, micro_batch_tokens=16384)
    sync = timing.step_time(LLAMA_8B, _grpo_8b(1024), Candidate(**split), H100X8, Efficiency())
    ahead = timing.step_time(LLAMA_8B, _grpo_8b(1024), Candidate(**split, max_staleness=1), H100X8, Efficiency())
    assert sync.step == pytest.approx(sync.generate + sync.learn + sync.weight_sync, rel=1e-12)
    assert ahead.step == pytest.approx(max(ahead.generate, ahead.learn) + ahead.weight_sync, rel=1e-12)
    assert ahead.step < 0.7 * sync.step  # the shorter phase (generation, ~26 of ~72 s) hides


def test_scale_moe_decode_reads_the_active_experts() -> None:
    moe = catalogue.CATALOGUE["qwen3-30b-a3b"]
    # one sequence reads the experts it is routed to: the active parameters but the input embedding
    active = catalogue.active_param_count(moe) - moe.vocab * moe.hidden
    assert timing.decode_weight_bytes(moe, 1, "bf16") == pytest.approx(2 * active, rel=1e-12)
    # 256 sequences touch 1 - (120/128)^256 of the experts: all but ~7e-8
    everything = catalogue.param_count(moe) - moe.vocab * moe.hidden
    assert timing.decode_weight_bytes(moe, 256, "bf16") == pytest.approx(2 * everything, rel=1e-6)
    layout = Candidate(LearnerLayout(dp_shard=2, ep=4), generator_replicas=8, micro_batch_tokens=16384)
    t = timing.step_time(moe, _grpo_8b(1024), layout, Cluster(gpus=16), Efficiency())
    assert t.comm["ep"] > 0 and t.comm["fsdp"] > 0


def test_the_per_token_overhead_grows_with_the_tokens_of_each_phase() -> None:
    """``eff.token_overhead_s`` adds seconds per token per layer per forward-equivalent;
    each phase's difference with and without it, worked by hand (1 ms a token-layer)."""
    with_it = Efficiency(**(EFF.__dict__ | {"token_overhead_s": 1e-3}))
    c = cand(dp_shard=2)
    # learner: 3 passes x 8 samples / 2 ranks x 200 tokens x 10 layers x 1 ms = 24 s
    diff = timing.learner_forwards(SPEC, WORK, c, CLUSTER, with_it, 3.0) - timing.learner_forwards(
        SPEC, WORK, c, CLUSTER, EFF, 3.0)
    assert diff == pytest.approx(24.0, rel=1e-9)
    gen = cand(generator_tp=2, generator_replicas=1)
    # prefill: 4 prompts x 100 tokens x 10 layers / tp 2 x 1 ms = 2 s
    assert timing.prefill(SPEC, WORK, gen, CLUSTER, with_it) - timing.prefill(SPEC, WORK, gen, CLUSTER, EFF) \
        == pytest.approx(2.0, rel=1e-9)
    # decode: 100 tokens x 10 layers x 8 sequences / tp 2 x 1 ms = 4 s
    assert timing.decode(SPEC, WORK, gen, CLUSTER, with_it) - timing.decode(SPEC, WORK, gen, CLUSTER, EFF) \
        == pytest.approx(4.0, rel=1e-9)
