"""Every online algorithm of the registry learns on the tiny model: the digit-share reward
(an untrained model writes about one digit in ten characters) rises clearly within 30
steps. PPO's critic also fits: its value error falls. The controls (lr 0 for the policy)
do not rise; a wrong sign in any estimator makes its test fail."""

from __future__ import annotations

import statistics

import pytest

from rltune.runtime.local import build_run
from rltune.runtime.loop import train

VARIANTS = {
    "dr_grpo": [],
    "dapo": ["algo.overlong_buffer=2"],
    "gspo": [],
    "rloo": [],
    "reinforce_pp": [],
    "reinforce_pp_baseline": [],
    "ppo": ["algo.critic_lr=3e-3", "algo.minibatches=2"],
}


def _run(cfg) -> list[dict]:
    return train(build_run(cfg))


pytestmark = pytest.mark.usefixtures("keep_torch_threads")
ONE_THREAD = "train.threads=1"  # tiny matrices: one thread is faster, and steady on a busy machine


def _gain(history: list[dict], key: str = "reward/mean") -> tuple[float, float]:
    curve = [m[key] for m in history if key in m]
    return statistics.mean(curve[:5]), statistics.mean(curve[-5:])


@pytest.mark.parametrize("algo", sorted(VARIANTS))
def test_online_algorithm_raises_the_reward(tiny_grpo_config, algo: str) -> None:
    history = _run(tiny_grpo_config(f"algo.name={algo}", ONE_THREAD, *VARIANTS[algo]))
    first, last = _gain(history)
    assert first < 0.3, [m["reward/mean"] for m in history]
    assert last > first + 0.25, [m["reward/mean"] for m in history]
    if algo == "ppo":
        err_first, err_last = _gain(history, "critic/value_error")
        assert err_last < 0.5 * err_first, [m["critic/value_error"] for m in history]
    if algo == "dapo":
        assert all(m["groups/kept_frac"] <= 1.0 for m in history)
        assert all("reward/overlong" in m for m in history)


@pytest.mark.parametrize("algo", ["ppo", "reinforce_pp"])
def test_control_with_zero_policy_lr_does_not_learn(tiny_grpo_config, algo: str) -> None:
    critic = ["algo.critic_lr=3e-3"] if algo == "ppo" else []  # the critic still learns; the policy does not
    history = _run(tiny_grpo_config(f"algo.name={algo}", ONE_THREAD, "train.lr=0", *critic))
    first, last = _gain(history)
    assert abs(last - first) < 0.08, [m["reward/mean"] for m in history]


def test_a_new_algorithm_is_one_registry_entry(tiny_grpo_config, monkeypatch) -> None:
    """An estimator that follows the sequence convention (here ``group_baseline``: reward
    minus the group mean, Dr.GRPO's advantage by another name) trains from a registry
    entry alone: no config, runtime or learner edit."""
    from rltune.algos import ALGORITHMS, group_baseline
    from rltune.algos.registry import online_algorithm

    monkeypatch.setitem(ALGORITHMS, "mean_baseline", online_algorithm("mean_baseline", group_baseline))
    history = _run(tiny_grpo_config("algo.name=mean_baseline", ONE_THREAD))
    first, last = _gain(history)
    assert last > first + 0.25, [m["reward/mean"] for m in history]
