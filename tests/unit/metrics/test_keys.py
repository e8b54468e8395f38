"""Metric keys: what the constructors build the parsers read back, and the reward names a
key reserves."""

from __future__ import annotations

import pytest

from rltune.metrics import keys

NAMES = ["exact_numeric", "fmt", "len_penalty2"]


def test_reward_names_read_back_what_reward_key_built() -> None:
    logged = [keys.reward_key(n) for n in NAMES]
    logged += [keys.REWARD_MEAN, keys.REWARD_STD, keys.REWARD_ERRORS, keys.REWARD_TIMEOUTS, keys.REWARD_DROPPED]
    logged += [keys.reward_errors_key(n) for n in NAMES] + [keys.reward_time_key(n) for n in NAMES]
    logged += [keys.perf_reward_calls_key(n) for n in NAMES] + [keys.accuracy_key(n) for n in NAMES]
    logged += [keys.eval_key(keys.reward_key(n)) for n in NAMES] + ["reward/min", "reward/max", keys.KL]
    assert keys.reward_names(reversed(logged)) == sorted(NAMES)
    assert keys.reward_names([keys.REWARD_MEAN, "reward/errors/fmt"]) == []


def test_the_keys_are_the_names_runs_have_always_logged() -> None:
    assert [keys.reward_key("fmt"), keys.reward_errors_key("fmt"), keys.reward_time_key("fmt")] == [
        "reward/fmt", "reward/errors/fmt", "time/reward/fmt"]
    assert [keys.time_key(p) for p in keys.TIME_PHASES] == [
        "time/generate", "time/score", "time/experience", "time/learn", "time/sync"]
    assert (keys.TIME_STEP, keys.EVAL_REWARD_MEAN, keys.eval_key(keys.PREF_MARGIN)) == (
        "time/step", "eval/reward/mean", "eval/pref/margin")
    assert (keys.accuracy_key("fmt"), keys.critic_key("loss"), keys.perf_reward_calls_key("fmt")) == (
        "accuracy/fmt", "critic/loss", "perf/reward_calls/fmt")


def test_held_out_scores_and_their_labels() -> None:
    row = {"step": 3, keys.EVAL_REWARD_MEAN: 0.5, keys.eval_key(keys.REWARD_STD): 0.1,
           keys.eval_key(keys.REWARD_ERRORS): 1.0, keys.eval_key(keys.reward_key("fmt")): 1.0,
           keys.eval_key(keys.PREF_ACCURACY): 0.75, keys.eval_key(keys.LENGTH_MEAN): 4.0, keys.REWARD_MEAN: 0.2}
    assert keys.held_out_scores(row) == ["eval/reward/mean", "eval/reward/fmt", "eval/pref/accuracy"]
    assert keys.held_out_scores(row, with_mean=False) == ["eval/reward/fmt", "eval/pref/accuracy"]
    assert [keys.held_out_label(k) for k in keys.held_out_scores(row)] == ["mean", "fmt", "pref/accuracy"]
    for name in NAMES:
        assert keys.held_out_label(keys.eval_key(keys.reward_key(name))) == name
    assert all(keys.is_eval_key(k) for k in keys.held_out_scores(row)) and not keys.is_eval_key(keys.REWARD_MEAN)


@pytest.mark.parametrize("name", sorted(keys.RESERVED_REWARD_NAMES))
def test_a_reserved_name_is_named_as_such(name: str) -> None:
    problem = keys.reward_name_problem(name)
    assert problem is not None and problem.startswith(f"the name {name!r} is reserved")


@pytest.mark.parametrize("name", sorted(keys.RUNTIME_REWARDS))
def test_a_runtime_reward_name_is_free_in_a_run_that_does_not_add_it(name: str) -> None:
    assert keys.reward_name_problem(name, runtime_rewards=()) is None
    assert keys.reward_name_problem(name, runtime_rewards={name}) is not None


@pytest.mark.parametrize(("name", "fragment"), [("", "must not be empty"), ("a/b", "contains '/'")])
def test_a_name_that_would_not_read_back_is_refused(name: str, fragment: str) -> None:
    assert fragment in keys.reward_name_problem(name)


def test_every_reserved_name_is_one_a_parser_would_misread_or_the_runtime_writes() -> None:
    # each statistic reads back as no reward function; the runtime's own entries are the rest
    assert keys.reward_names(keys.reward_key(n) for n in keys.REWARD_STATS) == []
    assert keys.RESERVED_REWARD_NAMES == keys.REWARD_STATS | {keys.ENV_REWARD, keys.OVERLONG_REWARD}
    assert all(keys.reward_name_problem(n) is None for n in NAMES)
