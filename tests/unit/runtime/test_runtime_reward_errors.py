"""RewardErrorWatch: each kind of reward error printed once, all-failed steps warned about
and counted in a row, the stop after ``max_failed_steps``; and the console's error count."""

from __future__ import annotations

import pytest
import torch

from rltune.data.records import Rollout
from rltune.metrics.sinks import format_stats
from rltune.runtime.reward_errors import RewardErrorLimit, RewardErrorWatch, error_kind


def _rollout(reward: float | None = None, error: str | None = None, dropped: bool = False,
             env_error: str | None = None) -> Rollout:
    return Rollout(
        prompt_id="p", group=0, prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2]),
        completion_logprobs=None, loss_mask=torch.ones(1), text="x", finish_reason="stop",
        policy_version=0, reward=reward, reward_error=error if env_error is None else env_error,
        dropped=dropped, env_error=env_error,
    )


@pytest.mark.parametrize(("message", "kind"), [
    ("f: ValueError: cannot parse 'x'", "f: ValueError"),
    ("f: ValueError: another text", "f: ValueError"),
    ("f: KeyError: 'answer'", "f: KeyError"),
    ("f: returned str 'high' (expected a finite number)", "f: returned str"),
    ("f: returned float nan (expected a finite number)", "f: returned float"),
    ("f: returned None", "f: returned None"),
    ("g: timed out (call took over 0.5 s)", "g: timed out"),
    ("no reward function is configured and the sample is not an episode",
     "no reward function is configured and the sample is not an episode"),
    ("env: step raised RuntimeError: tool 3 failed", "env: step raised RuntimeError"),
    ("env: step returned dict, not StepResult", "env: step returned dict, not StepResult"),
])
def test_error_kind(message, kind):
    assert error_kind(message) == kind


def test_each_kind_is_printed_once_with_its_first_message():
    said = []
    watch = RewardErrorWatch(3, said.append)
    watch.observe(1, [_rollout(1.0), _rollout(error="f: ValueError: a"), _rollout(error="f: ValueError: b")])
    watch.observe(2, [_rollout(error="f: returned None"), _rollout(error="f: ValueError: c"), _rollout(0.0)])
    assert said == [
        "reward error at step 1 (first of its kind, not repeated): f: ValueError: a",
        "reward error at step 2 (first of its kind, not repeated): f: returned None",
    ]
    watch.check()  # no step failed on every sample


def test_steps_that_fail_on_every_sample_stop_after_the_limit_in_a_row():
    said = []
    watch = RewardErrorWatch(2, said.append)
    all_failed = [_rollout(error="f: returned str 'high' (expected a finite number)")] * 4
    watch.observe(1, all_failed)
    watch.check()
    watch.observe(2, [_rollout(0.5), *all_failed])  # one scored sample: the count starts over
    watch.check()
    watch.observe(3, all_failed)
    watch.check()
    watch.observe(4, [_rollout(error="f: ValueError: boom")] * 2)
    assert said[1:] == [
        "warning: step 1: the reward failed on all 4 samples, so the step learned nothing "
        "(1 of 2 in a row before the run stops)",
        "warning: step 3: the reward failed on all 4 samples, so the step learned nothing "
        "(1 of 2 in a row before the run stops)",
        "reward error at step 4 (first of its kind, not repeated): f: ValueError: boom",
        "warning: step 4: the reward failed on all 2 samples, so the step learned nothing "
        "(2 of 2 in a row before the run stops)",
    ]
    with pytest.raises(RewardErrorLimit) as info:
        watch.check()
    # the first message of the failing streak (step 3), not of the run
    assert str(info.value).startswith(
        "the reward failed on every sample of 2 steps in a row (steps 3-4), so the run stopped: "
        "f: returned str 'high' (expected a finite number). "
    )


def test_dropped_samples_and_empty_steps_are_not_failures():
    said = []
    watch = RewardErrorWatch(1, said.append)
    watch.observe(1, [_rollout(error="safety: dropped: unsafe", dropped=True)] * 3)
    watch.observe(2, [])
    watch.check()
    assert said == []


def test_zero_warns_but_never_stops():
    said = []
    watch = RewardErrorWatch(0, said.append)
    for step in range(1, 6):
        watch.observe(step, [_rollout(error="f: returned None")])
        watch.check()
    assert said[-1] == (
        "warning: step 5: the reward failed on all 1 samples, so the step learned nothing "
        "(train.max_reward_error_steps=0: the run goes on)"
    )


def test_messages_are_escaped_for_the_console():
    said = []
    RewardErrorWatch(3, said.append).observe(1, [_rollout(1.0), _rollout(error="f: KeyError: '[bold]'")])
    assert said == ["reward error at step 1 (first of its kind, not repeated): f: KeyError: '\\[bold]'"]


def test_console_line_shows_the_error_count_only_when_there_are_errors():
    base = {"reward/mean": 0.5, "kl": 0.01, "loss": 0.2, "time/step": 1.0}
    assert format_stats({**base, "reward/errors": 0.0}) == "reward 0.500  kl 0.0100  loss 0.2000  1.00 s/step"
    assert format_stats({**base, "reward/errors": 3.0, "reward/timeouts": 0.0}) == (
        "reward 0.500  errors 3  kl 0.0100  loss 0.2000  1.00 s/step")
    assert format_stats({**base, "reward/mean": None, "reward/errors": 4.0, "reward/timeouts": 2.0}) == (
        "reward -  errors 4 (2 timed out)  kl 0.0100  loss 0.2000  1.00 s/step")


ENV_ERROR = "env: step raised RuntimeError: tool 3 failed"


def test_environment_errors_are_worded_as_the_environments():
    said = []
    watch = RewardErrorWatch(2, said.append)
    watch.observe(1, [_rollout(env_error=ENV_ERROR)] * 2)
    watch.observe(2, [_rollout(env_error="env: reset raised KeyError: 'x'")] * 2)
    assert said == [
        f"environment error at step 1 (first of its kind, not repeated): {ENV_ERROR}",
        "warning: step 1: the environment failed on all 2 samples, so the step learned nothing "
        "(1 of 2 in a row before the run stops)",
        "environment error at step 2 (first of its kind, not repeated): env: reset raised KeyError: 'x'",
        "warning: step 2: the environment failed on all 2 samples, so the step learned nothing "
        "(2 of 2 in a row before the run stops)",
    ]
    with pytest.raises(RewardErrorLimit) as info:
        watch.check()
    assert str(info.value) == (
        "the environment failed on every sample of 2 steps in a row (steps 1-2), so the run stopped: "
        f"{ENV_ERROR}. Fix the environment (samples.jsonl has each sample's error), or raise "
        "`train.max_reward_error_steps` (0 never stops)"
    )


def test_a_streak_of_both_kinds_names_both():
    said = []
    watch = RewardErrorWatch(2, said.append)
    watch.observe(1, [_rollout(env_error=ENV_ERROR)])
    watch.observe(2, [_rollout(error="f: returned None"), _rollout(env_error=ENV_ERROR)])
    assert said[-1] == (
        "warning: step 2: the environment or the reward failed on all 2 samples, so the step learned "
        "nothing (2 of 2 in a row before the run stops)"
    )
    with pytest.raises(RewardErrorLimit) as info:
        watch.check()
    assert str(info.value).startswith(
        "the environment or the reward failed on every sample of 2 steps in a row (steps 1-2), so the "
        f"run stopped: {ENV_ERROR}. Fix the environment and the reward function (samples.jsonl"
    )


def test_a_new_streak_forgets_the_sources_of_the_last():
    watch = RewardErrorWatch(1, lambda line: None)
    watch.observe(1, [_rollout(env_error=ENV_ERROR)])
    watch.observe(2, [_rollout(1.0)])
    watch.observe(3, [_rollout(error="f: returned None")])
    with pytest.raises(RewardErrorLimit, match=r"^the reward failed .* Fix the reward function \("):
        watch.check()


def test_a_long_message_is_printed_cut_and_kept_whole_in_the_rollout():
    """The console shows a message's first 300 characters (samples.jsonl has it whole)."""
    from rltune.runtime.reward_errors import _MAX_PRINTED, RewardErrorLimit, RewardErrorWatch

    said: list[str] = []
    watch = RewardErrorWatch(1, said.append)
    message = "fmt: KeyError: " + "k" * 5000
    rollouts = [_rollout(None, error=message)]
    watch.observe(1, rollouts)
    assert len(said[0]) < _MAX_PRINTED + 200 and said[0].endswith("(the whole message is in samples.jsonl)")
    assert rollouts[0].reward_error == message
    with pytest.raises(RewardErrorLimit) as err:
        watch.check()
    assert "k" * 5000 not in str(err.value) and "(the whole message is in samples.jsonl)" in str(err.value)
