"""DAPO's overlong penalty measures an episode against the episode's budget: its
completion holds every turn and observation, which ``rollout.max_new_tokens`` (one turn)
would call overlong every time."""

from __future__ import annotations

import torch

from rltune.algos import ALGORITHMS, config_problems
from rltune.config import load_config
from rltune.data.records import Rollout
from rltune.runtime.collect import Collector


def _rollout(length: int) -> Rollout:
    ids = torch.zeros(length, dtype=torch.long)
    return Rollout(prompt_id="p", group=0, prompt_ids=torch.zeros(3, dtype=torch.long), completion_ids=ids,
                   completion_logprobs=None, loss_mask=torch.ones(length), text="", finish_reason="stop",
                   policy_version=0, reward=1.0)


def _penalties(*overrides: str) -> list[float]:
    cfg = load_config(None, ["algo.name=dapo", "reward.0.fn=m:f", "rollout.max_new_tokens=8",
                             "algo.overlong_buffer=4", "algo.overlong_penalty=1.0", *overrides])
    rollouts = [_rollout(n) for n in (3, 6, 8, 40, 62, 64)]
    Collector(cfg, data=None, generator=None, scorer=None)._apply_overlong_penalty(rollouts)
    return [r.rewards["overlong"] for r in rollouts]


def test_a_completion_is_measured_against_max_new_tokens() -> None:
    # zone (4, 8]: -(L - 4) / 4; past 8 the whole penalty
    assert _penalties() == [0.0, -0.5, -1.0, -1.0, -1.0, -1.0]


def test_an_episode_is_measured_against_its_token_budget() -> None:
    # env.max_total_tokens=64: zone (60, 64]
    assert _penalties("env.name=m:make", "env.max_total_tokens=64") == [0.0, 0.0, 0.0, 0.0, -0.5, -1.0]


def test_a_one_turn_episode_is_measured_against_its_turn() -> None:
    # max_turns=1: no observation follows the turn, so it is cut at max_new_tokens (8)
    assert _penalties("env.name=m:make", "env.max_turns=1", "env.max_total_tokens=64") == _penalties()


def test_the_buffer_is_checked_against_the_same_limit() -> None:
    cfg = load_config(None, ["algo.name=dapo", "reward.0.fn=m:f", "rollout.max_new_tokens=8",
                             "algo.overlong_buffer=16", "env.name=m:make", "env.max_total_tokens=64"])
    assert not [p for p in config_problems(ALGORITHMS["dapo"], cfg) if "overlong" in p]
    cfg = load_config(None, ["algo.name=dapo", "reward.0.fn=m:f", "algo.overlong_buffer=100",
                             "env.name=m:make", "env.max_total_tokens=64"])
    assert "algo.overlong_buffer=100 is longer than env.max_total_tokens=64" in "; ".join(
        config_problems(ALGORITHMS["dapo"], cfg))
