"""GRPO on the tiny model raises a reward that an untrained model rarely earns; the same
run with lr 0 (the control) does not. A wrong loss sign makes the first test fail."""

from __future__ import annotations

import statistics

from rltune.runtime.local import build_run
from rltune.runtime.loop import train


def _reward_curve(cfg) -> list[float]:
    history = train(build_run(cfg))
    return [m["reward/mean"] for m in history]


def test_grpo_raises_the_reward(tiny_grpo_config):
    curve = _reward_curve(tiny_grpo_config())
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    # an untrained model writes about one digit in ten characters
    assert first < 0.3, curve
    assert last > first + 0.3, curve


def test_control_with_zero_lr_does_not_learn(tiny_grpo_config):
    curve = _reward_curve(tiny_grpo_config("train.lr=0"))
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    assert abs(last - first) < 0.08, curve
