"""One layout's simulation filled from the cost model (``rltune/plan/simulate_layout.py``),
against hand arithmetic for Qwen2.5-7B on H100s."""

from __future__ import annotations

import pytest

from rltune.plan import timing
from rltune.plan.catalogue import CATALOGUE
from rltune.plan.errors import PlanError
from rltune.plan.simulate import CycleLengths
from rltune.plan.simulate_layout import pipeline_for, simulate_layout, split_devices
from rltune.plan.spec import Candidate, Cluster, Efficiency, LearnerLayout, Workload

QWEN = CATALOGUE["qwen2.5-7b"]
WORK = Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=64, group_size=8,
                prompt_tokens=512, completion_tokens=2048)


@pytest.mark.parametrize(("gpus", "share", "tp", "replicas", "layout"), [
    (8, 0.25, 1, 2, LearnerLayout(dp_shard=6)),
    (32, 0.5, 2, 8, LearnerLayout(dp_shard=8, dp_replicate=2)),          # 16 generating, 16 learning
    (1024, 0.25, 1, 256, LearnerLayout(dp_shard=8, dp_replicate=96)),
])
def test_devices_split_into_replicas_and_a_sharded_learner(gpus, share, tp, replicas, layout):
    assert split_devices(gpus, share, tp, 8) == (replicas, layout)


@pytest.mark.parametrize(("gpus", "share", "says"), [
    (8, 1.0, "leaves no learner"),
    (40, 0.25, "30 learner devices do not fill whole nodes of 8"),
])
def test_splits_that_leave_no_learner_or_part_of_a_node_are_refused(gpus, share, says):
    with pytest.raises(PlanError, match=says):
        split_devices(gpus, share, 1, 8)


def test_the_pipeline_is_the_cost_models_decode_roofline_and_step():
    cand = Candidate(learner=LearnerLayout(dp_shard=4), generator_replicas=4, weight_sync="broadcast")
    cluster, eff = Cluster(gpus=8, memory_gb=24.0), Efficiency()
    p = pipeline_for(QWEN, WORK, cand, cluster, eff, CycleLengths((1000,)))
    rate = 3350e9 * 0.6                               # HBM x decode_bandwidth
    # decode reads every weight but the input embedding: (7,615,616,512 - 152,064 x 3,584)
    # params x 2 bytes = 14,141,238,272 bytes
    assert p.per_step_s == pytest.approx(14_141_238_272 / rate, rel=1e-9)
    # KV of a token: 2 x 28 layers x 4 heads x 128 x 2 bytes = 57,344; a sequence's mean
    # context 512 + 1,000 / 2 = 1,012 tokens
    assert p.per_sequence_s == pytest.approx(57_344 * 1_012 / rate, rel=1e-9)
    # compute-bound: 2 x matmul params + 4 x 28 x 28 x 128 x 1,012 attention FLOPs per
    # token at 989 TFLOP/s x 0.3; matmul params: 28 x (3,584 x (2 x 3,584 + 2 x 512) +
    # 3 x 3,584 x 18,944) + the LM head 152,064 x 3,584 = 7,070,285,824
    matmul = 28 * (3584 * (2 * 3584 + 2 * 512) + 3 * 3584 * 18944) + 152_064 * 3584
    assert matmul == 7_070_285_824
    flops = 2 * matmul + 4 * 28 * 28 * 128 * 1_012
    assert p.compute_per_sequence_s == pytest.approx(flops / (989e12 * 0.3), rel=1e-9)
    # 24 GB x 0.9 less the weights (7,615,616,512 x 2 bytes) over 57,344 x 1,512 bytes a
    # sequence: (21.6e9 - 15,231,233,024) / 86,704,128 = 73.45 -> 73 slots
    assert p.slots == 73
    # the prompt's prefill, shared by its group of 8: 512 x 2 x matmul FLOPs + 512 x 4 x 28
    # x 28 x 128 x 256.5 attention FLOPs (mean context (512 + 1) / 2) at 989 TFLOP/s x 0.5
    prompt = 512 * 2 * matmul + 512 * 4 * 28 * 28 * 128 * 256.5
    assert p.prefill_s == pytest.approx(prompt / (989e12 * 0.5) / 8, rel=1e-9)
    # the learner's phases and the sync are step_time's at the mean completion length
    t = timing.step_time(QWEN, Workload(**{**WORK.__dict__, "completion_tokens": 1000}), cand, cluster, eff)
    assert (p.learn_s, p.sync_s, p.load_s) == (t.learn, t.weight_sync, t.weight_sync)
    assert (p.batch, p.generators) == (512, 4)


def test_constant_lengths_reproduce_the_closed_form_synchronous_step():
    # every completion at the limit, one wave per replica, in turn: the simulation's step
    # is generate + learn + sync; its decode reads the KV at the mean context P + L/2
    # where step_time sums token by token (mean P + (L+1)/2): 8.1413 against 8.1408
    # samples/s, within 0.1 %
    sim = simulate_layout(QWEN, WORK, Cluster(gpus=8), Efficiency(), 8, 0.5, 0,
                          lengths=CycleLengths((2048,)), weight_sync="broadcast", steps=4, warmup=1)
    t = timing.step_time(QWEN, WORK, sim.candidate, Cluster(gpus=8), Efficiency())
    assert sim.result.samples_per_s == pytest.approx(WORK.samples_per_step / t.step, rel=1e-3)


def test_generating_ahead_and_continuous_batching_raise_throughput_at_scale():
    kw = dict(weight_sync="broadcast", activation_checkpointing="full", steps=8, warmup=2)
    cluster = Cluster(gpus=64)
    base = simulate_layout(QWEN, WORK, cluster, Efficiency(), 64, 0.5, 0, **kw)
    ahead = simulate_layout(QWEN, WORK, cluster, Efficiency(), 64, 0.5, 2, **kw)
    cont = simulate_layout(QWEN, WORK, cluster, Efficiency(), 64, 0.5, 2, batching="continuous", **kw)
    assert base.problems == ()
    assert base.result.samples_per_s < ahead.result.samples_per_s <= cont.result.samples_per_s
    assert cont.result.staleness_max <= 2
