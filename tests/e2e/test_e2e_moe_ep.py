"""``rltune train`` of GRPO on ``builtin:tiny-moe`` with its experts split over two learner
ranks on Ray (``runtime.placement.learners: 2``, ``train.parallel.ep: 2``): the reward
rises where the same run at lr 0 stays flat, and the first step (the same samples as a
one-process run: one generator, the same seed and weights) has the one-process run's
loss, gradient norm and expert load.

Slow: each run starts a local Ray and three actors (~1.5 min on two cores)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed")

from digit_runs import digit_runner, ends  # noqa: E402

pytestmark = pytest.mark.slow

EP = ("runtime.mode=ray", "runtime.placement.learners=2", "train.parallel.ep=2")
LOAD_KEYS = ("moe/load_max", "moe/load_min", "moe/load/e0", "moe/load/e1", "moe/load/e2", "moe/load/e3")


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory):
    return digit_runner(tmp_path_factory.mktemp("moe-ep"), "builtin:tiny-moe")


def test_grpo_at_ep2_raises_the_reward_and_lr0_does_not(train_run) -> None:
    learned = train_run("ep2", *EP)
    control = train_run("ep2-lr0", *EP, "train.lr=0")
    first, last = ends(learned)
    # one process on this config: 0.06 over the first five steps, 0.62 over the last five
    assert first < 0.3 and last > first + 0.3, [m["reward/mean"] for m in learned]
    c_first, c_last = ends(control)
    assert abs(c_last - c_first) < 0.08, [m["reward/mean"] for m in control]
    assert last > c_last + 0.3


def test_first_step_at_ep2_is_one_process_step(train_run) -> None:
    # the same prompts and samples (one generator, seed and weights alike): the reward is
    # the same to the bit; the learner's sums over the ranks differ from one process's by
    # fp32 rounding only (rel 1e-5, as in tests/distributed/test_layouts_ep.py), and the
    # routing counts are integers summed over the ranks (load shares to 1e-6). The router's
    # balance loss is off: in any data-parallel group each rank's is its own rows' (a
    # product of per-batch fractions, not additive over rows), as with ddp and fsdp2
    step = ("train.steps=1", "model.router_aux_loss_coef=0")
    one = train_run("one", *step)[0]
    ep2 = train_run("ep2-one", *EP, *step)[0]
    assert ep2["reward/mean"] == one["reward/mean"]
    # the first on-policy GRPO loss is ~0 (advantages centred per group, ratio 1): a sum
    # of O(1e-1) terms whose fp32 rounding is ~1e-8, so it compares absolutely
    assert ep2["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert ep2["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for key in LOAD_KEYS:
        assert ep2[key] == pytest.approx(one[key], abs=1e-6), key
    # the generator's expert load: the same samples, counted on the generator actor on
    # Ray and in the process locally; integer counts, so equal exactly
    generated = [k for k, v in one.items() if k.startswith("gen/moe/") and isinstance(v, float)]
    assert generated and all(ep2.get(k) == one[k] for k in generated), {k: (one[k], ep2.get(k)) for k in generated}
