"""The planner's memory terms (``rltune/plan/memory.py``) against values worked by hand,
the ZeRO paper's and Korthikanti et al.'s published arithmetic, and a KV cache worked out
for Llama-3.1-8B. The arithmetic is written beside each expected value."""

from __future__ import annotations

import dataclasses

import pytest

from rltune.plan import memory as m
from rltune.plan.catalogue import CATALOGUE, param_count
from rltune.plan.errors import PlanError
from rltune.plan.spec import GB, Candidate, Cluster, LearnerLayout, ModelSpec, Workload

# hidden 8, 2 layers, 2 heads of 4 (q width 8), 1 KV head (kv width 4), MLP 16, vocab 10.
# A layer: q, o 8x8 each, k, v 8x4 each = 2*64 + 2*32 = 192; two RMSNorms 2*8 = 16;
# MLP 3*8*16 = 384 -> 592. Embedding + head 2*10*8 = 160; final norm 8.
# Total 160 + 2*592 + 8 = 1352.
TINY = ModelSpec(name="t", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
# The same with 4 routed experts of width 4 (2 per token) in every layer: a layer's MLP is
# the router 8*4 = 32 + 4 experts * 3*8*4 = 384 -> 416; layer 192 + 16 + 416 = 624.
MOE = dataclasses.replace(TINY, name="m", experts=4, experts_per_token=2, expert_intermediate=4)
GPU = Cluster(gpus=8)


def work(**changes) -> Workload:
    base = dict(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=8, group_size=4,
                prompt_tokens=24, completion_tokens=40, precision="fp32")
    return Workload(**(base | changes))


def test_tiny_specs_count_as_worked_out():
    assert param_count(TINY) == 1352
    assert param_count(MOE) == 160 + 2 * 624 + 8  # = 1416


# ----------------------------------------------------------------------- model states


def test_bytes_per_param_at_each_precision():
    # rltune: weights in model.dtype, autocast over them: fp32 4 + grads 4 + Adam 2*4 = 16
    for precision in ("fp32", "bf16", "fp16", "fp8"):
        assert m.bytes_per_param(precision) == {"weights": 4, "gradients": 4, "optimizer": 8, "master": 0}
        assert sum(m.bytes_per_param(precision).values()) == 16
    # model.dtype bfloat16: 2 + 2 + 2*2 = 8
    assert sum(m.bytes_per_param("bf16", model_dtype="bfloat16").values()) == 8
    # a frozen LoRA base weight: its weights only
    assert m.bytes_per_param("bf16", lora=True) == {"weights": 4, "gradients": 0, "optimizer": 0, "master": 0}
    with pytest.raises(PlanError, match="train.precision='int8'"):
        m.bytes_per_param("int8")


def test_zero_paper_example():
    # Rajbhandari et al. 2020, section 3.1/5: a 7.5 B model under mixed-precision Adam takes
    # 16 x 7.5e9 = 120 GB; partitioned over 64 GPUs (ZeRO stage 3): 120 / 64 = 1.875 GB.
    per = sum(m.bytes_per_param("bf16").values())
    assert per * 7.5e9 == 120e9
    assert per * 7.5e9 / 64 == pytest.approx(1.875e9, rel=1e-12)
    # the same through the sharding of a whole model: states = 16 x params / dp_shard
    cand = Candidate(learner=LearnerLayout(dp_shard=64))
    states = m.model_state_bytes(TINY, work(precision="bf16"), cand)
    assert sum(states.values()) == pytest.approx(16 * 1352 / 64, rel=1e-12)  # = 338.0


def test_param_split_over_tp_pp_ep():
    # pp=1: everything, 1352 (embedding + head + 2 layers + final norm); tp=2 halves it
    assert m.param_split(TINY, LearnerLayout()) == (1352, 0)
    assert m.param_split(TINY, LearnerLayout(tp=2)) == (676, 0)
    # pp=2: stage 0 = layer 0 + embedding = 592 + 80 = 672; stage 1 = layer 1 + head +
    # final norm = 592 + 80 + 8 = 680, the larger
    assert m.param_split(TINY, LearnerLayout(pp=2)) == (680, 0)
    # MoE, pp=1: experts 2 layers * 384 = 768 routed; the rest 1416 - 768 = 648 dense.
    # ep=2: 768 / 2 = 384; tp=2 splits the dense part only: 648 / 2 = 324
    assert m.param_split(MOE, LearnerLayout(ep=2, tp=2)) == (324, 384)
    # FSDP: dense over dp_shard*ep = 4 -> 81; routed over dp_shard = 2 -> 192
    assert m.sharded_params(MOE, LearnerLayout(ep=2, tp=2, dp_shard=2)) == 81 + 192
    # dp_replicate shards nothing
    assert m.sharded_params(TINY, LearnerLayout(dp_replicate=4)) == 1352
    with pytest.raises(PlanError, match="pp=3 for a model of 2 layers"):
        m.param_split(TINY, LearnerLayout(pp=3))


def test_stage_layers_as_the_pipeline_cuts_them():
    # 10 layers over 4 stages: 10 // 4 = 2 each, the first 10 % 4 = 2 stages one more
    assert m.stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_lora_adapters_and_frozen_base():
    # r(in + out) per linear: q 8+8, k 8+4, v 8+4, o 8+8 = 56 r; gate, up, down 3(8+16) = 72 r
    # -> 128 r per layer, 2 layers: 256 r; r = 2: 512
    assert m.lora_params(TINY, 2) == 512
    states = m.model_state_bytes(TINY, work(lora_rank=2), Candidate(learner=LearnerLayout()))
    # base 1352 * 4 bytes frozen + adapters 512 * 4; grads 512 * 4; Adam 512 * 8
    assert states == {"weights": 1352 * 4 + 512 * 4, "gradients": 512 * 4, "optimizer": 512 * 8, "master": 0}


def test_offload():
    w = work()
    opt = m.model_state_bytes(TINY, w, Candidate(learner=LearnerLayout(), offload="optimizer"))
    assert opt == {"weights": 1352 * 4, "gradients": 1352 * 4, "optimizer": 0, "master": 0}
    # host: copies of weights and grads + moments, (4 + 4 + 8) * 1352
    assert m.host_bytes(TINY, w, Candidate(learner=LearnerLayout(), offload="optimizer")) == 16 * 1352
    # params: the device keeps 2 gathered blocks (2 * 592 * 4) and one block's grads (592 * 4)
    cand = Candidate(learner=LearnerLayout(dp_shard=2), offload="params")
    assert m.model_state_bytes(TINY, w, cand) == {"weights": 2 * 592 * 4, "gradients": 592 * 4,
                                                  "optimizer": 0, "master": 0}
    assert m.host_bytes(TINY, w, cand) == 16 * 1352 / 2  # the shards, 16 bytes each
    assert m.fsdp_buffer_bytes(TINY, w, cand) == 0  # counted as the weights above


# ------------------------------------------------------------------------ activations


def test_layer_activations_against_korthikanti():
    # GPT-3 175B's shape (Korthikanti et al. 2022, Table 3): a = 96, h = 12288, s = 2048.
    # Their eq. 1 per layer: sbh (34 + 5as/h) = 2048*12288*(34 + 80) = 2,868,903,936 bytes.
    # With SDPA the 5as/h scores and with no dropout its 2 sbh of masks go: sbh * 32.
    # A gated MLP of width 2h saves h + 4*2h = 9h values, as their GeLU MLP (h + 2*4h).
    h, a, s = 12288, 96, 2048
    assert s * h * (34 + 5 * a * s / h) == 2_868_903_936
    gpt = ModelSpec(name="gpt3", hidden=h, layers=96, heads=a, kv_heads=a, head_dim=h // a,
                    intermediate=2 * h, vocab=50257)
    ours = m.layer_activation_bytes(gpt, sparse=False, compute=2)
    # ours = 32 h (theirs, flash, no dropout) + 12 h (RMSNorm keeps input and normalised
    # output in fp32: 4h * 4 bytes = 16 h, against their 2 inputs * 2 bytes = 4 h)
    # + 4 a (SDPA's fp32 log-sum-exp per head)
    assert ours == 32 * h + 12 * h + 4 * a  # = 541,056 bytes per token per layer
    # tensor parallel t = 8 without sequence parallelism (their eq. 2, sbh (10 + 24/t),
    # flash and no dropout: 8 + 24/t): the norms and the two region inputs stay whole
    ours_tp = m.layer_activation_bytes(gpt, sparse=False, compute=2, tp=8)
    assert ours_tp == pytest.approx((8 + 12) * h + (24 * h + 4 * a) / 8, rel=1e-12)
    assert m.layer_activation_bytes(gpt, sparse=False, compute=2, tp=8, sequence_parallel=True) == ours / 8


def test_layer_activations_gqa_and_moe():
    # TINY, fp32: norms 4*8*4 = 128; region inputs 2*8*4 = 64; q, o 2*8 and k, v 2*4 -> 24*4 = 96;
    # log-sum-exp 2 heads * 4 = 8; MLP 4*16*4 = 256. Total 552.
    assert m.layer_activation_bytes(TINY, sparse=False, compute=4) == 552
    # MoE layer: router 4 experts * 4 = 16; 2 routed copies of (8 + 4*4) = 48 values * 4 = 192
    # -> 128 + 64 + 96 + 8 + 16 + 192 = 504; tp=2 leaves the routed part whole:
    # 128 + 64 + 16 + 192 + (96 + 8) / 2 = 452
    assert m.layer_activation_bytes(MOE, sparse=True, compute=4) == 504
    assert m.layer_activation_bytes(MOE, sparse=True, compute=4, tp=2) == 452


def test_micro_batches_and_pipeline_in_flight():
    w = work()  # 32 rows of 64 tokens
    # 512 tokens hold 8 rows; 32 rows / 2 data ranks = 16 -> 2 micro-batches of 8
    cand = Candidate(learner=LearnerLayout(dp_shard=2), micro_batch_tokens=512)
    assert m.micro_batches(w, cand) == (8, 2)
    # fewer tokens than a row: one row each; 32 / 1 rank = 32 micro-batches
    assert m.micro_batches(w, Candidate(learner=LearnerLayout(), micro_batch_tokens=10)) == (1, 32)
    # pp=2 with 32 micro-batches: 1F1B holds pp = 2 at once, GPipe all 32
    pp = LearnerLayout(pp=2)
    assert m.pipeline_in_flight(w, Candidate(learner=pp, micro_batch_tokens=64)) == 2
    gpipe = dataclasses.replace(pp, pp_schedule="gpipe")
    assert m.pipeline_in_flight(w, Candidate(learner=gpipe, micro_batch_tokens=64)) == 32


def test_activation_bytes_by_checkpointing():
    w = work()  # 64 tokens per row; micro-batch of 512 tokens = 8 rows = 512 tokens
    layer = 512 * 552  # tokens x TINY's 552 bytes per token per layer = 282,624
    cand = Candidate(learner=LearnerLayout(), micro_batch_tokens=512)
    assert m.activation_bytes(TINY, w, cand) == 2 * layer
    # full: each block keeps its input, 512 tokens * 8 * 4 bytes = 16,384, plus one block
    # recomputed in full
    full = dataclasses.replace(cand, activation_checkpointing="full")
    assert m.activation_bytes(TINY, w, full) == 2 * 16_384 + layer
    # selective (k = 2) checkpoints block 1 only: block 0 whole + block 1's input + its recompute
    sel = dataclasses.replace(cand, activation_checkpointing="selective")
    assert m.activation_bytes(TINY, w, sel) == layer + 16_384 + layer
    # bf16 autocast over fp32 weights: 2-byte values in the regions (552 - 96 - 32 - 128 = 296
    # bytes at 2 instead of 4 -> norms 128 + region inputs 32 + (24 values)*2 = 48 + 8 + 128
    # = 344 per token) and each block's 16-bit weight copies, 2 * 592 bytes
    bf16 = m.activation_bytes(TINY, work(precision="bf16"), cand)
    assert bf16 == 2 * (512 * 344 + 2 * 592)


def test_logits_bytes():
    # chunks of 1,024 at Qwen's 151,936 vocabulary: 4 copies * 1024 * 151936 * 4 bytes
    qwen = dataclasses.replace(TINY, vocab=151_936)
    w = work(completion_tokens=2000, prompt_tokens=48, logprob_chunk_tokens=1024)
    cand = Candidate(learner=LearnerLayout(), micro_batch_tokens=4096)  # 2 rows alive
    assert m.logits_bytes(qwen, w, cand) == 4 * 1024 * 151_936 * 4  # = 2,489,319,424
    # chunk 0: every completion token of the micro-batch, 2 * 2000; tp=2 halves the vocabulary
    full = dataclasses.replace(w, logprob_chunk_tokens=0)
    tp = Candidate(learner=LearnerLayout(tp=2), micro_batch_tokens=4096)
    assert m.logits_bytes(qwen, full, tp) == 4 * 4000 * 151_936 / 2 * 4


# ----------------------------------------------------------- reference, critic, generator


def test_reference_and_critic():
    cand = Candidate(learner=LearnerLayout(dp_shard=2))
    # reference: frozen, model.dtype fp32, sharded like the policy: 4 * 1352 / 2
    assert m.reference_bytes(TINY, work(reference=True), cand) == 2704
    assert m.reference_bytes(TINY, work(reference=True, lora_rank=4), cand) == 0  # adapters off
    assert m.reference_bytes(TINY, work(), cand) == 0
    # critic: body without the untied head (1352 - 80) + value head 8 + 1 = 1281 parameters,
    # 16 bytes each, over dp_shard = 2
    assert m.critic_params(TINY) == 1281
    assert m.critic_bytes(TINY, work(critic=True), cand) == pytest.approx(16 * 1281 / 2, rel=1e-12)


def test_kv_cache_of_llama_8b():
    spec = CATALOGUE["llama-3.1-8b"]
    # bf16 KV per token: 2 * 32 layers * 8 KV heads * 128 * 2 bytes = 131,072 (128 KiB)
    w = work(precision="bf16", rollout_precision="bf16", prompt_tokens=512, completion_tokens=512)
    # 8 prompts * 4 samples / 2 replicas = 16 sequences * 1024 tokens * 131,072 = 2 GiB
    cand = Candidate(learner=LearnerLayout(), generator_replicas=2)
    assert m.kv_cache_bytes(spec, w, cand) == 16 * 1024 * 131_072  # = 2,147,483,648
    assert m.kv_cache_bytes(spec, w, dataclasses.replace(cand, generator_tp=2)) == 16 * 1024 * 131_072 / 2
    # 16 ranks for 8 KV heads: one head each, replicated: / 8, not / 16
    assert m.kv_cache_bytes(spec, w, dataclasses.replace(cand, generator_tp=16)) == 16 * 1024 * 131_072 / 8


def test_generator_memory():
    spec = CATALOGUE["llama-3.1-8b"]
    w = work(precision="bf16", prompt_tokens=512, completion_tokens=512)
    cand = Candidate(learner=LearnerLayout(), generator_replicas=2, generator_tp=2)
    mem = m.generator_memory(spec, w, cand, GPU)
    assert mem.weights == param_count(spec) * 2 / 2  # bf16 weights over 2 ranks
    assert mem.kv_cache == 16 * 1024 * 131_072 / 2
    assert mem.workspace == 2e9  # CUDA context 1 GB + vLLM's graphs and activations 1 GB
    assert m.generator_memory(spec, work(generates=False), cand, GPU).total == 0
    # rollout in fp32 takes model.dtype's bytes
    assert m.rollout_bytes(work(rollout_precision="fp32", model_dtype="bfloat16")) == 2


# ------------------------------------------------------------------------------ roles


def test_learner_memory_adds_its_terms():
    w = work(reference=True)
    cand = Candidate(learner=LearnerLayout(dp_shard=2), micro_batch_tokens=512)
    mem = m.learner_memory(TINY, w, cand, GPU)
    assert (mem.weights, mem.gradients, mem.optimizer) == (1352 * 4 / 2, 1352 * 4 / 2, 1352 * 8 / 2)
    assert mem.activations == 2 * 512 * 552 and mem.reference == 2704
    # FSDP buffers: 2 gathered blocks + 1 block of grads, a block = 592 parameters * 4 bytes:
    # 3 * 592 * 4 = 7104; workspace = that + 1 GB + 10 % of all allocated
    allocated = mem.weights + mem.gradients + mem.optimizer + mem.activations + mem.logits + mem.reference + 7104
    assert mem.workspace == pytest.approx(7104 + 1e9 + 0.1 * allocated, rel=1e-12)
    cpu = m.learner_memory(TINY, w, cand, Cluster(gpus=1, kind="cpu"))
    assert cpu.workspace == 7104 + m.CPU_PROCESS_BYTES


def test_memory_problems_name_the_role_and_layout():
    spec = CATALOGUE["llama-3.1-70b"]
    w = work(precision="bf16", prompt_tokens=512, completion_tokens=512)
    cand = Candidate(learner=LearnerLayout(dp_shard=4), micro_batch_tokens=4096, activation_checkpointing="full")
    need = m.learner_memory(spec, w, cand, GPU).total / GB
    # 70.6e9 params * 16 bytes / 4 = 282 GB of states alone
    assert need > 282
    # generator at tp=1: bf16 weights 2 * 70,553,706,496 = 141.1 GB + KV 32 sequences * 1024
    # tokens * (2 * 80 * 8 * 128 * 2 = 327,680 bytes) = 10.7 GB + 2 GB workspace = 153.8 GB
    assert param_count(spec) == 70_553_706_496
    assert m.memory_problems(spec, w, cand, GPU) == [
        f"learner needs {need:.1f} GB per device at dp_shard=4 tp=1 pp=1, has 80",
        "generator needs 153.8 GB per device at generator_tp=1, has 80",
    ]
    small = CATALOGUE["qwen2.5-1.5b"]
    fits = Candidate(learner=LearnerLayout(dp_shard=8), micro_batch_tokens=4096, activation_checkpointing="full")
    assert m.memory_problems(small, w, fits, GPU) == []
    colocated = dataclasses.replace(fits, colocate=True)
    tight = Cluster(gpus=8, memory_gb=10)
    [line] = m.memory_problems(small, w, colocated, tight)
    assert line.startswith("learner and generator together need ") and line.endswith(", has 10")


def test_min_devices_to_fit():
    spec = CATALOGUE["llama-3.1-70b"]
    w = work(precision="bf16", prompt_tokens=512, completion_tokens=512)

    def total(k: int, offload: str = "none") -> float:
        cand = Candidate(learner=LearnerLayout(dp_shard=k), micro_batch_tokens=1, activation_checkpointing="full",
                         offload=offload)
        return m.learner_memory(spec, w, cand, GPU).total

    # states on the devices: 16 * 70.55e9 = 1128.9 GB / n; one row (1,024 tokens) with every
    # block checkpointed: activations 4.84 GB, logits 1.05 GB; FSDP buffers 3 blocks * 856 M *
    # 4 = 10.27 GB. Fits when 1.1 * (1128.9 / n + 16.16) + 1 <= 80, i.e. 1128.9 / n <= 55.66,
    # n >= 20.28: 21 devices
    assert total(21) <= 80 * GB < total(20)
    # FSDP2's offload: params (n > 1) puts the states on the host: a device keeps the row's
    # activations and logits and the gathered blocks, 1.1 * 16.16 + 1 = 18.8 GB, so 2 devices
    # do (the search plans such layouts: the minimum must not say more)
    assert total(2, "params") == pytest.approx(1.1 * (4.84e9 + 1.05e9 + 10.27e9) + 1e9, rel=0.01)
    assert m.min_devices_to_fit(spec, w, GPU) == 2
    # a CPU cluster offloads nothing (host and device are one memory; rltune refuses it there)
    assert m.min_devices_to_fit(spec, w, dataclasses.replace(GPU, kind="cpu")) > 2
    # one device offloads nothing: a model whose states fit one device needs 1
    assert m.min_devices_to_fit(CATALOGUE["tiny"], w, GPU) == 1
    # 16 GB: below the 18.8 GB that no sharding or offload removes, at any device count
    with pytest.raises(PlanError, match="even sharded over 2048 devices"):
        m.min_devices_to_fit(spec, w, Cluster(gpus=8, memory_gb=16))


# ------------------------------------------------------------- sums over layers, by kind

# 7 layers: 3 dense, then 4 MoE with a shared expert; every layer kind is in some stage.
MIXED = dataclasses.replace(MOE, name="mixed", layers=7, dense_layers=3, shared_expert_intermediate=6)


def _brute_activation_bytes(spec: ModelSpec, w: Workload, cand: Candidate) -> float:
    """activation_bytes block by block, as its docstring reads, for the counting form."""
    from rltune.learner.memory import checkpointed_indices
    from rltune.plan.catalogue import layer_params

    rows, _ = m.micro_batches(w, cand)
    tokens, lay = rows * w.tokens_per_sample, cand.learner
    span = m.stage_layers(spec.layers, lay.pp)[0]
    kept = set(checkpointed_indices(spec.layers, cand.activation_checkpointing, m.CHECKPOINT_EVERY))
    copies = 2.0 if w.precision != "fp32" and w.model_dtype == "float32" else 0.0
    routed = m.expert_params(spec) / (spec.layers - spec.dense_layers)
    saved, recompute = 0.0, 0.0
    for i in span:
        sparse = i >= spec.dense_layers
        experts = routed if sparse else 0.0
        full = tokens * m.layer_activation_bytes(spec, sparse=sparse, compute=m.compute_bytes(w), tp=lay.tp) \
            + copies * ((layer_params(spec, i) - experts) / lay.tp + experts / lay.ep)
        saved += tokens * spec.hidden * 4 if i in kept else full
        recompute = max(recompute, full) if i in kept else recompute
    return m.pipeline_in_flight(w, cand) * saved + recompute


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_checkpointed_count_is_what_the_learner_checkpoints(mode):
    from rltune.learner.memory import checkpointed_indices

    picked = checkpointed_indices(9, mode, m.CHECKPOINT_EVERY)
    for lo in range(10):
        for hi in range(lo, 10):
            assert m.checkpointed_count(lo, hi, mode) == sum(lo <= i < hi for i in picked), (lo, hi)


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_activation_bytes_counts_each_kind_as_block_by_block(pp, mode):
    """The dense and the MoE blocks of the first stage (of 3 dense + 4 MoE layers over pp
    stages: both kinds at pp 1 and 2, dense only at pp 3) give the same bytes as adding
    them one by one; only the summation order differs (a few ulps)."""
    w = work(precision="bf16")
    cand = Candidate(LearnerLayout(pp=pp, tp=2, ep=2, dp_shard=2), micro_batch_tokens=128, activation_checkpointing=mode)
    assert m.activation_bytes(MIXED, w, cand) == pytest.approx(_brute_activation_bytes(MIXED, w, cand), rel=1e-12)


def test_parameter_sums_count_each_kind_as_layer_by_layer():
    from rltune.plan.catalogue import layer_params, lora_params

    layers = [layer_params(MIXED, i) for i in range(MIXED.layers)]
    assert layers[:3] == [layers[0]] * 3 and layers[3:] == [layers[3]] * 4 and layers[0] != layers[3]
    assert param_count(MIXED) == 160 + sum(layers) + 8
    # LoRA r=2: attention (8+8) + 2 (8+4) + (8+8) = 56 per layer x 2; MLP 3 x 2 (8 + width)
    assert lora_params(MIXED, 2) == 7 * 2 * 56 + 3 * 6 * (8 + 16) + 4 * 6 * (8 + 6)
    whole = m.param_split(MIXED, LearnerLayout())
    routed = m.expert_params(MIXED)
    assert whole == (param_count(MIXED) - routed, routed)
    # pp 2: stages 0-3 (3 dense, 1 MoE) and 4-6 (3 MoE); the first holds the embedding,
    # the last the head and final norm (untied); the larger one is reported
    per_moe = routed / 4
    first = sum(layers[:4]) - per_moe + 80, per_moe
    last = sum(layers[4:]) - 3 * per_moe + 80 + 8, 3 * per_moe
    assert m.param_split(MIXED, LearnerLayout(pp=2)) == max(first, last, key=sum)


def test_a_plan_does_the_same_work_at_40_layers_as_at_40000(monkeypatch):
    """Each layer kind is counted once, so a candidate costs the same at any depth (a
    config.json with a mistaken layer count is answered in seconds, not hours)."""
    from rltune.plan import catalogue

    calls = []
    inner = catalogue._attention_weights
    monkeypatch.setattr(catalogue, "_attention_weights", lambda spec: calls.append(1) or inner(spec))
    counts = []
    for layers in (40, 40_000):  # the same kinds of block in each stage
        spec = dataclasses.replace(MIXED, layers=layers)
        calls.clear()
        m.learner_memory(spec, work(lora_rank=None), Candidate(LearnerLayout(pp=2), micro_batch_tokens=64,
                                                               activation_checkpointing="selective"), GPU)
        counts.append(len(calls))
    assert counts[0] == counts[1] > 0
