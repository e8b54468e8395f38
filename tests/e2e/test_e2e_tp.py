"""``rltune train`` of GRPO on ``builtin:tiny`` split over two tensor-parallel learner ranks
on Ray (``runtime.placement.learners: 2``, ``train.parallel.tp: 2``): attention heads, MLP
columns and the (tied) vocabulary split in two, the log-probs read off vocabulary-sharded
logits. The reward rises where the same run at lr 0 stays flat, and the first step (the
same samples as a one-process run: one generator, the same seed and weights) has the
one-process run's loss and gradient norm.

Slow: each run starts a local Ray and three actors (~1.5 min on two cores)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed")

from digit_runs import digit_runner, ends  # noqa: E402

pytestmark = pytest.mark.slow

TP = ("runtime.mode=ray", "runtime.placement.learners=2", "train.parallel.tp=2")


@pytest.fixture(scope="module")
def train_run(tmp_path_factory: pytest.TempPathFactory):
    return digit_runner(tmp_path_factory.mktemp("tp"), "builtin:tiny")


def test_grpo_at_tp2_raises_the_reward_and_lr0_does_not(train_run) -> None:
    learned = train_run("tp2", *TP)
    control = train_run("tp2-lr0", *TP, "train.lr=0")
    first, last = ends(learned)
    # an untrained model writes about one digit in ten characters
    assert first < 0.3 and last > first + 0.3, [m["reward/mean"] for m in learned]
    c_first, c_last = ends(control)
    assert abs(c_last - c_first) < 0.08, [m["reward/mean"] for m in control]
    assert last > c_last + 0.3


def test_first_step_at_tp2_is_one_process_step(train_run) -> None:
    # the same prompts and samples (one generator, seed and weights alike): the reward is
    # the same to the bit; the two tp ranks' split sums differ from one process's by fp32
    # rounding only (rel 1e-5, as in tests/distributed/test_layouts_tp.py)
    one = train_run("one", "train.steps=1")[0]
    tp2 = train_run("tp2-one", *TP, "train.steps=1")[0]
    assert tp2["reward/mean"] == one["reward/mean"]
    for key in ("loss", "grad_norm"):
        assert tp2[key] == pytest.approx(one[key], rel=1e-5), key
