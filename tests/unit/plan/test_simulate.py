"""The pipeline simulation against cases worked by hand (``rltune/plan/simulate.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from rltune.plan.errors import PlanError
from rltune.plan.simulate import CycleLengths, LognormalLengths, Pipeline, simulate


def one_to_one(**kw) -> Pipeline:
    """One generator, one learner, constant lengths: 4 samples of 100 tokens, a decode step
    of 0.01 + 0.0025 x 4 = 0.02 s, prefill 0.05 s a sample: generation lasts
    4 x 0.05 + 100 x 0.02 = 2.2 s."""
    base = dict(batch=4, generators=1, slots=8, per_step_s=0.01, per_sequence_s=0.0025,
                learn_s=1.5, sync_s=0.3, max_staleness=0, lengths=CycleLengths((100,)), prefill_s=0.05)
    return Pipeline(**(base | kw))


def test_synchronous_throughput_is_batch_over_the_sum_of_the_phases():
    r = simulate(one_to_one(), steps=6, warmup=2)
    # k = 0: 4 / (2.2 + 1.5 + 0.3) = 4 / 4.0 = 1.0 samples/s
    assert r.samples_per_s == pytest.approx(1.0, rel=1e-12)
    assert r.generator_busy == pytest.approx(2.2 / 4.0, rel=1e-12)
    assert r.generator_slot_use == pytest.approx(2.2 / 4.0 * 4 / 8, rel=1e-12)  # 4 of 8 slots while busy
    assert r.learner_busy == pytest.approx(1.5 / 4.0, rel=1e-12)
    assert r.learner_sync == pytest.approx(0.3 / 4.0, rel=1e-12)
    # the learner waits for generation 2.2 s of 4; the generator waits on the bound 1.8 s
    assert r.idle == pytest.approx({"generator/barrier": 0.0, "generator/staleness": 1.8 / 4.0,
                                    "learner/generation": 2.2 / 4.0}, rel=1e-12)
    assert (r.staleness_mean, r.staleness_max) == (0.0, 0)


@pytest.mark.parametrize(("learn_s", "sync_s", "expected"), [
    (1.5, 0.3, 4 / 2.2),   # generation-bound: max(2.2, 1.8) = 2.2 s a step
    (3.0, 0.5, 4 / 3.5),   # learner-bound: max(2.2, 3.5) = 3.5 s a step
])
def test_one_step_ahead_overlaps_generation_with_learning(learn_s, sync_s, expected):
    r = simulate(one_to_one(learn_s=learn_s, sync_s=sync_s, max_staleness=1), steps=8, warmup=3)
    assert r.samples_per_s == pytest.approx(expected, rel=1e-12)
    assert r.staleness_max == 1


def alternating(k: int, **kw) -> Pipeline:
    """Batches of 2 whose completions alternate 1 token (batch 0, 2, ...) and 3 tokens
    (batch 1, 3, ...) at 1 s a decode step: generation lasts 1 s, 3 s, 1 s, ...; learning
    2 s a step, no sync."""
    base = dict(batch=2, generators=1, slots=2, per_step_s=1.0, per_sequence_s=0.0, learn_s=2.0,
                sync_s=0.0, max_staleness=k, lengths=CycleLengths((1, 1, 3, 3)))
    return Pipeline(**(base | kw))


def test_generating_ahead_hides_the_variance_of_generation():
    # k = 0: generate, learn, generate, learn: (1 + 2) + (3 + 2) = 8 s per two steps
    assert simulate(alternating(0), steps=10, warmup=2).samples_per_s == pytest.approx(4 / 8, rel=1e-12)
    # k = 1, worked out event by event (G: batch j generated, L: step j learned; version j+1
    # at the end of step j): G0 [0,1] G1 [1,4] L0 [1,3] G2 [4,5] L1 [4,6] G3 waits for
    # version 2 (batch 3 needs v >= 3 - 1): [6,9] L2 [6,8] G4 [9,10] L3 [9,11] G5 waits for
    # version 4: [11,14] L4 [11,13] ...: steps end at 3, 6, 8, 11, 13, 16, 18, 21: 5 s per
    # two steps, from the end of step 1 (6) to the end of step 9 (26)
    r1 = simulate(alternating(1), steps=10, warmup=2)
    assert r1.samples_per_s == pytest.approx(4 / 5, rel=1e-12)
    assert [s.end for s in r1.steps[:8]] == pytest.approx([3, 6, 8, 11, 13, 16, 18, 21], abs=1e-12)
    # k = 2: the short batch runs ahead too; both sides need 4 s per two steps
    assert simulate(alternating(2), steps=10, warmup=2).samples_per_s == pytest.approx(4 / 4, rel=1e-12)


def test_continuous_batching_refills_a_slot_when_a_completion_ends():
    # lengths 1 and 3 in every batch of 2, two slots, learning free (0 s), a bound that
    # never holds: a static batch lasts 3 s (its longest): 2 / 3 samples/s
    p = alternating(50, lengths=CycleLengths((1, 3)), learn_s=0.0)
    assert simulate(p, steps=12, warmup=4).samples_per_s == pytest.approx(2 / 3, rel=1e-12)
    # continuous: each slot decodes 1 token a second and a sample takes 2 tokens on average,
    # so 2 slots give 1 sample/s (batch j completes at 2j + 3: slot A runs s0 [0,1] s2 [1,2]
    # s3 [2,5], slot B s1 [0,3] s4 [3,4] s5 [4,7], ...)
    r = simulate(dataclasses.replace(p, batching="continuous"), steps=12, warmup=4)
    assert r.samples_per_s == pytest.approx(1.0, rel=1e-12)
    assert r.generator_slot_use == pytest.approx(1.0, rel=1e-12)


def test_replicas_of_a_static_batch_wait_for_the_slowest():
    # two replicas, one sample each, 1 and 3 tokens at 1 s a step, learn 1 s, k = 0: a step
    # is 3 + 1 = 4 s; replica 0 waits 2 s for replica 1 (barrier), both wait 1 s for the
    # learner (staleness); busy (1 + 3) of 2 x 4 replica-seconds
    p = alternating(0, generators=2, lengths=CycleLengths((1, 3)), learn_s=1.0)
    r = simulate(p, steps=6, warmup=2)
    assert r.samples_per_s == pytest.approx(2 / 4, rel=1e-12)
    assert r.generator_busy == pytest.approx(4 / 8, rel=1e-12)
    assert r.idle["generator/barrier"] == pytest.approx(2 / 8, rel=1e-12)
    assert r.idle["generator/staleness"] == pytest.approx(2 / 8, rel=1e-12)


def test_refilling_within_a_share_ends_a_batch_with_its_longest_sample():
    # one replica, 2 slots, batches of 4 with completions 1, 3, 1, 1 at 1 s a token, the
    # bound never holding, learning free. Static waves: (1, 3) then (1, 1): 3 + 1 = 4 s a
    # batch. Refill: s0 [0,1] s1 [0,3] s2 [1,2] s3 [2,3]: 3 s a batch. Continuous keeps both
    # slots full across batches: 2 tokens/s at 6 / 4 tokens a sample: 4 / 3 samples/s too.
    p = alternating(50, batch=4, lengths=CycleLengths((1, 3, 1, 1)), learn_s=0.0)
    assert simulate(p, steps=10, warmup=2).samples_per_s == pytest.approx(4 / 4, rel=1e-12)
    for batching in ("refill", "continuous"):
        r = simulate(dataclasses.replace(p, batching=batching), steps=10, warmup=2)
        assert r.samples_per_s == pytest.approx(4 / 3, rel=1e-12)


def test_a_replica_does_not_start_the_next_batch_before_the_others_finish():
    # two replicas; replica 0's completions are 1, 3, 1, 3 ... tokens, replica 1's 3, 1, 3,
    # 1 ...; learning free, the bound never holding. Each batch waits for its 3-token
    # sample: 2 samples per 3 s, a third of replica-time at the barrier (2 of 6 s). Without
    # the barrier each replica would run 4 s per two batches: 1 sample/s.
    p = alternating(50, generators=2, lengths=CycleLengths((1, 3, 3, 1)), learn_s=0.0)
    r = simulate(p, steps=12, warmup=4)
    assert r.samples_per_s == pytest.approx(2 / 3, rel=1e-12)
    assert r.idle["generator/barrier"] == pytest.approx(1 / 3, rel=1e-12)
    assert r.idle["generator/staleness"] == 0.0
    # refilling within a share of one sample changes nothing
    assert simulate(dataclasses.replace(p, batching="refill"), steps=12, warmup=4).samples_per_s == \
        pytest.approx(2 / 3, rel=1e-12)
    # continuous batching has neither barrier nor waves: all 4 slots (2 a replica) stay
    # full, decoding 1 token/s each, at 2 tokens a sample on average: 2 samples/s
    r = simulate(dataclasses.replace(p, batching="continuous"), steps=12, warmup=4)
    assert r.samples_per_s == pytest.approx(2.0, rel=1e-12)
    assert r.generator_slot_use == pytest.approx(1.0, rel=1e-12)


def test_decode_steps_follow_the_roofline():
    # 4 sequences of 10 tokens; memory-bound 0.01 + 0.001 x 4 = 0.014 s a step against
    # compute-bound 0.005 x 4 = 0.02 s: 10 x 0.02 = 0.2 s of generation, + 0.8 s learning
    p = one_to_one(per_step_s=0.01, per_sequence_s=0.001, compute_per_sequence_s=0.005,
                   lengths=CycleLengths((10,)), prefill_s=0.0, learn_s=0.8, sync_s=0.0)
    assert simulate(p, steps=5, warmup=1).samples_per_s == pytest.approx(4 / 1.0, rel=1e-12)


def test_slots_cut_a_static_share_into_waves():
    # 4 samples of 100 tokens, 2 slots: two waves of 100 x (0.01 + 0.0025 x 2) = 1.5 s
    # plus 2 x 0.05 s prefill each: 3.2 s, + 1.8 s: 4 samples per 5 s
    r = simulate(one_to_one(slots=2), steps=5, warmup=1)
    assert r.samples_per_s == pytest.approx(4 / 5.0, rel=1e-12)


@pytest.mark.parametrize("batching", ["static", "refill", "continuous"])
@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_the_staleness_bound_holds_on_every_learned_batch(k, batching):
    p = Pipeline(batch=64, generators=3, slots=16, per_step_s=0.01, per_sequence_s=1e-4,
                 learn_s=5.0, sync_s=0.5, max_staleness=k, batching=batching,
                 lengths=LognormalLengths(median=200, sigma=0.99, max_tokens=2048))
    r = simulate(p, steps=16, warmup=2, seed=3)
    assert len(r.steps) == 16
    assert all(s.staleness_max <= k for s in r.steps)
    assert r.staleness_max <= k
    if k == 0:
        assert all(s.staleness_mean == 0.0 for s in r.steps)


def test_a_seed_fixes_the_run_and_another_seed_changes_it():
    p = Pipeline(batch=32, generators=2, slots=8, per_step_s=0.01, per_sequence_s=1e-4,
                 learn_s=1.0, sync_s=0.1, max_staleness=1, batching="continuous",
                 lengths=LognormalLengths(median=200, sigma=0.99, max_tokens=2048))
    a, b, c = simulate(p, seed=7), simulate(p, seed=7), simulate(p, seed=8)
    assert a == b and a.steps == b.steps
    assert a.samples_per_s != c.samples_per_s


def test_lognormal_lengths_are_clipped_to_the_limit():
    import random
    rng = random.Random(0)
    draws = [LognormalLengths(median=1000, sigma=0.99, max_tokens=4096).draw(rng, i) for i in range(4000)]
    assert max(draws) == 4096 and min(draws) >= 1
    # P(L >= 4096) = P(Z >= ln(4.096) / 0.99 = 1.424) = 7.7 %; 4,000 draws: +- 1.7 % (4 sigma)
    assert sum(d == 4096 for d in draws) / len(draws) == pytest.approx(0.077, abs=0.017)
    # the median of the draws is the distribution's, 1,000, within 4 sigma of a median
    # estimate: 4 x 1.2533 x 0.99 / sqrt(4000) = 0.078 in ln, ~ 8 % of the value
    assert sorted(draws)[2000] == pytest.approx(1000, rel=0.08)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("batch", 0, "batch=0 must be at least 1"),
    ("learn_s", -1.0, "learn_s=-1.0 must not be negative"),
    ("max_staleness", -1, "max_staleness=-1"),
    ("batching", "dynamic", "batching='dynamic', expected one of static, refill, continuous"),
    ("per_step_s", 0.0, None),
])
def test_bad_pipelines_are_refused_with_the_field_named(field, value, says):
    p = dataclasses.replace(one_to_one(), **{field: value})
    if says is None:  # per_step_s alone at 0 is fine: sequences still cost time
        simulate(p, steps=3, warmup=1)
        return
    with pytest.raises(PlanError, match=says):
        simulate(p, steps=3, warmup=1)


def test_a_decode_step_of_no_time_is_refused():
    p = one_to_one(per_step_s=0.0, per_sequence_s=0.0)
    with pytest.raises(PlanError, match="a decode step takes no time"):
        simulate(p)


def test_a_replica_taking_new_weights_stalls_for_the_load():
    # k = 1, load 0.3 s on the generator's side too (the sync on both paths): every batch
    # from batch 2 on is generated by a version the replica does not hold yet, taken while
    # it generates the batch before, so a step takes max(2.2 + 0.3, 1.5 + 0.3) = 2.5 s
    r = simulate(one_to_one(max_staleness=1, load_s=0.3), steps=8, warmup=3)
    assert r.samples_per_s == pytest.approx(4 / 2.5, rel=1e-12)
    # k = 0: the replica sits idle through the sync and receives the weights then: 4.0 s as
    # without the load; a load longer than the sync stalls for the rest (0.5 - 0.3 s)
    assert simulate(one_to_one(load_s=0.3), steps=6, warmup=2).samples_per_s == pytest.approx(4 / 4.0, rel=1e-12)
    assert simulate(one_to_one(load_s=0.5), steps=6, warmup=2).samples_per_s == pytest.approx(4 / 4.2, rel=1e-12)
    # learner-bound (learn 3.0 s): the replica waits on the bound through the sync, so the
    # load is free: max(2.2, 3.0) + 0.3 = 3.3 s
    r = simulate(one_to_one(max_staleness=1, learn_s=3.0, load_s=0.3), steps=8, warmup=3)
    assert r.samples_per_s == pytest.approx(4 / 3.3, rel=1e-12)
