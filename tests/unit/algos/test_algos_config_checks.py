"""What a run config cannot learn with, refused by the registry before anything loads:
settings that would fail only after a step's generation (a greedy rollout temperature, an
overlong zone longer than the completion limit), or would run without learning (a critic
warm-up as long as the run, dynamic sampling with one sample per prompt, rewards that all
weigh 0, more mini-batches than rows); and the KL and advantage keys that the other keys'
values leave unread."""

from __future__ import annotations

import pytest

from rltune.algos import ALGORITHMS, config_problems
from rltune.algos.registry import unread_keys
from rltune.config import load_config

REWARD = "reward=[{fn: builtin:exact_numeric}]"


def problems(*overrides: str) -> list[str]:
    cfg = load_config(None, list(overrides))
    return config_problems(ALGORITHMS[cfg.algo.name], cfg)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo.name=grpo", "rollout.temperature=0", REWARD],
         "rollout.temperature=0.0: algo.name=grpo learns from the log-probs of its samples at the sampling "
         "temperature, and greedy decoding has none; set rollout.temperature > 0 (greedy evaluation is "
         "eval.temperature: 0)"),
        (["algo.name=dapo", "algo.overlong_buffer=16", "rollout.max_new_tokens=8", REWARD],
         "algo.overlong_buffer=16 is longer than rollout.max_new_tokens=8: the soft overlong zone is the last "
         "overlong_buffer tokens before the limit; set overlong_buffer <= 8"),
        (["algo.name=reinforce_pp", "algo.dynamic_sampling=true", "algo.group_size=1", REWARD],
         "algo.dynamic_sampling keeps only groups whose rewards differ, and a group of algo.group_size=1 never "
         "has two: every batch would be empty; set group_size >= 2, or dynamic_sampling: false"),
        (["algo.name=grpo", "reward=[{fn: builtin:exact_numeric, weight: 0}, {fn: builtin:exact_text, weight: 0}]"],
         "every reward has weight 0 (reward[0].weight=0.0, reward[1].weight=0.0) and no env gives rewards: every "
         "sample of algo.name=grpo would score 0 and nothing would be learned; give a reward a nonzero weight"),
        (["algo.name=grpo", "algo.clip_low=1", REWARD],
         "algo.clip_low=1.0 puts the ratio's lower clip 1 - clip_low at or below 0, where a ratio never falls, so "
         "it would never clip; set clip_low below 1 (0.2 is PPO's)"),
        (["algo.name=gspo", "algo.clip_low=1.5", REWARD],
         "algo.clip_low=1.5 puts the ratio's lower clip 1 - clip_low at or below 0, where a ratio never falls, so "
         "it would never clip; set clip_low below 1 (0.2 is PPO's)"),
    ],
)
def test_what_would_fail_after_generating_or_learn_nothing_is_refused(overrides, expected):
    assert problems(*overrides) == [expected]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo.name=grpo", "train.prompts_per_step=2", "algo.group_size=2", "algo.minibatches=5", REWARD],
         "algo.minibatches=5 is more than the 4 rows a step learns on (train.prompts_per_step=2 x "
         "algo.group_size=2); set minibatches <= 4, or raise train.prompts_per_step"),
        (["algo.name=dpo", "train.prompts_per_step=4", "algo.minibatches=5"],
         "algo.minibatches=5 is more than the 4 pairs a step learns on (train.prompts_per_step=4); set "
         "minibatches <= 4, or raise train.prompts_per_step"),
        (["algo.name=sft", "train.prompts_per_step=4", "algo.minibatches=8"],
         "algo.minibatches=8 is more than the 4 rows a step learns on (train.prompts_per_step=4); set "
         "minibatches <= 4, or raise train.prompts_per_step"),
    ],
)
def test_more_minibatches_than_a_step_has_units_is_refused(overrides, expected):
    assert problems(*overrides) == [expected]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo.name=grpo", "algo.kl_kind=k2", REWARD],
         "algo.kl_kind=k2 does not apply to algo.name=grpo (kl_coef is 0: there is no KL term); remove it"),
        (["algo.name=ppo", "algo.kl_in_reward=true", REWARD],
         "algo.kl_in_reward=True does not apply to algo.name=ppo (kl_coef is 0: there is no KL to put in the "
         "reward); remove it"),
        (["algo.name=ppo", "algo.kl_coef=0.1", "algo.kl_in_reward=true", "algo.kl_horizon=100", REWARD],
         "algo.kl_horizon=100 does not apply to algo.name=ppo (kl_target is not set: the KL coefficient does "
         "not adapt); remove it"),
        (["algo.name=dr_grpo", "algo.adv_eps=1e-4", REWARD],
         "algo.adv_eps=0.0001 does not apply to algo.name=dr_grpo (adv_scale is none: its advantages are not "
         "divided by the std); remove it"),
        (["algo.name=grpo", "algo.adv_scale=none", "algo.adv_eps=1e-4", REWARD],
         "algo.adv_eps=0.0001 does not apply to algo.name=grpo (adv_scale is none: its advantages are not "
         "divided by the std); remove it"),
    ],
)
def test_a_key_that_the_other_keys_leave_unread_is_refused(overrides, expected):
    assert problems(*overrides) == [expected]


def test_the_limits_themselves_and_what_the_refused_settings_need_run():
    assert problems("algo.name=dapo", "algo.overlong_buffer=8", "rollout.max_new_tokens=8", REWARD) == []
    assert problems("algo.name=ppo", "algo.critic_warmup_steps=9", "train.steps=10", REWARD) == []
    assert problems("algo.name=ppo", "algo.critic_warmup_steps=10", "train.steps=0", REWARD) == []  # no step at all
    assert problems("algo.name=ppo", "algo.dynamic_sampling=true", "algo.group_size=2", REWARD) == []
    assert problems("algo.name=grpo", "algo.clip_low=0.99", REWARD) == []
    assert problems("algo.name=grpo", "train.prompts_per_step=2", "algo.group_size=2", "algo.minibatches=4",
                    REWARD) == []
    assert problems("algo.name=dpo", "train.prompts_per_step=4", "algo.minibatches=4") == []
    # greedy decoding is for evaluation; an algorithm that does not generate ignores the rollout temperature
    assert problems("algo.name=grpo", "eval.temperature=0", REWARD) == []
    assert problems("algo.name=sft", "rollout.temperature=0") == []


def test_rewards_weighing_0_are_refused_only_when_nothing_else_rewards():
    zero = "reward=[{fn: builtin:exact_numeric, weight: 0}]"
    assert problems("algo.name=grpo", zero, "env.name=builtin:tools") == []  # the episodes' own reward
    assert problems("algo.name=dapo", zero, "algo.overlong_buffer=2") == []  # the overlong penalty alone
    assert problems("algo.name=grpo", "reward=[{fn: builtin:exact_numeric, weight: 0}, "
                    "{fn: builtin:exact_text, weight: 0.5}]") == []
    assert problems("algo.name=sft", zero) == []  # offline: the reward scores only its evaluation


def test_a_group_baseline_says_its_own_group_size_rule_once():
    assert problems("algo.name=grpo", "algo.dynamic_sampling=true", "algo.group_size=1", REWARD) == [
        "algo.group_size must be >= 2 for grpo (the group is the baseline)"]


def test_kl_and_advantage_keys_are_read_where_their_term_exists():
    assert problems("algo.name=grpo", "algo.kl_coef=0.1", "algo.kl_kind=k2", REWARD) == []
    assert problems("algo.name=grpo", "algo.kl_kind=k3", REWARD) == []  # set to its default
    assert problems("algo.name=ppo", "algo.kl_coef=0.1", "algo.kl_in_reward=true", "algo.kl_target=0.1",
                    "algo.kl_horizon=100", REWARD) == []
    assert problems("algo.name=dr_grpo", "algo.adv_scale=std", "algo.adv_eps=1e-4", REWARD) == []
    assert problems("algo.name=dr_grpo", "algo.adv_eps=1e-6", REWARD) == []  # its default


def test_a_resume_does_not_count_a_key_left_unread_by_the_other_keys():
    # unread_keys is what a resume compares against (rltune.runtime.rundir)
    def unread(*overrides: str) -> set[str]:
        cfg = load_config(None, [*overrides, REWARD])
        return set(unread_keys(ALGORITHMS[cfg.algo.name], cfg))

    assert "algo.kl_kind" in unread("algo.name=grpo")
    assert "algo.kl_kind" not in unread("algo.name=grpo", "algo.kl_coef=0.1")
    assert "algo.kl_in_reward" in unread("algo.name=ppo")
    assert "algo.kl_in_reward" not in unread("algo.name=ppo", "algo.kl_coef=0.1", "algo.kl_in_reward=true")
    assert "algo.kl_horizon" in unread("algo.name=ppo", "algo.kl_coef=0.1", "algo.kl_in_reward=true")
    assert "algo.adv_eps" in unread("algo.name=dr_grpo")
    assert "algo.adv_eps" not in unread("algo.name=grpo")


def test_a_critic_warmup_covering_the_run_is_a_note_not_a_refusal() -> None:
    """A recipe's warm-up with a short smoke run (train.steps=1): only the critic learns,
    which the run says when it starts."""
    from rltune.algos.registry import critic_warmup_note

    cfg = load_config(None, ["algo.name=ppo", "algo.critic_warmup_steps=10", "train.steps=10", REWARD])
    assert config_problems(ALGORITHMS["ppo"], cfg) == []
    assert critic_warmup_note(ALGORITHMS["ppo"], cfg) == (
        "note: algo.critic_warmup_steps=10 covers all 10 steps of this run: only the critic learns, and the "
        "policy stays as it was (set algo.critic_warmup_steps below train.steps to train it)")
    shorter = load_config(None, ["algo.name=ppo", "algo.critic_warmup_steps=9", "train.steps=10", REWARD])
    assert critic_warmup_note(ALGORITHMS["ppo"], shorter) is None
