"""What the console says about held-out reward errors (the first message of each kind,
which reward failed on how many samples; the run goes on) and about steps whose batch was
empty (a warning each, no stop)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from rltune.data.records import Prompt, Rollout, SamplingParams, TrainBatch
from rltune.metrics import keys
from rltune.metrics.types import Aggregator, Sum
from rltune.rewards.builtin import exact_numeric
from rltune.rewards.scorer import LocalScorer, RewardFn
from rltune.runtime.evaluate import Evaluated, evaluate
from rltune.runtime.loop import _eval_metrics, train_step
from rltune.runtime.reward_errors import RewardErrorWatch, eval_failures
from rltune.runtime.sources import StepBatch


def _rollout(prompt_id: str = "p", reward: float | None = None, error: str | None = None,
             env_error: str | None = None) -> Rollout:
    return Rollout(
        prompt_id=prompt_id, group=0, prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2]),
        completion_logprobs=None, loss_mask=torch.ones(1), text="12", finish_reason="stop",
        policy_version=0, reward=reward, reward_error=error if env_error is None else env_error,
        env_error=env_error,
    )


class _Generator:
    def generate(self, prompts: list[Prompt], params: SamplingParams, *, group_offset: int = 0) -> list[Rollout]:
        return [_rollout(p.id) for p in prompts]


MISSING = "exact_numeric: ValueError: prompt 'e0': exact_numeric needs an `answer`"


def test_each_kind_of_eval_error_is_printed_once_and_never_stops_the_run() -> None:
    said: list[str] = []
    watch = RewardErrorWatch(1, said.append)
    failed = [_rollout(error=MISSING), _rollout(error=MISSING.replace("e0", "e1"))]
    watch.observe_eval(0, failed)
    watch.observe_eval(5, failed)
    watch.check()  # evaluations are not steps: nothing counts towards the limit
    watch.observe(1, failed)  # the same kind on training samples is said as theirs
    assert said[:2] == [
        f"eval reward error at step 0 (first of its kind, not repeated): {MISSING}",
        f"reward error at step 1 (first of its kind, not repeated): {MISSING}",
    ]


def test_a_long_eval_error_is_cut_without_pointing_at_samples_jsonl() -> None:
    said: list[str] = []
    RewardErrorWatch(1, said.append).observe_eval(2, [_rollout(error="f: ValueError: " + "x" * 400)])
    assert said[0].endswith("... (cut at 300 characters)"), said
    assert "samples.jsonl" not in said[0]


def test_eval_failures_name_what_failed() -> None:
    rollouts = [_rollout(error="f: KeyError: 'a'"), _rollout(env_error="env: reset raised OSError: x")]
    assert eval_failures({"f": 1.0, "g": 0.0}, rollouts) == "the environment failed on 1, reward f failed on 1"
    assert eval_failures({"f": 0.0}, [_rollout(1.0)]) == ""


def test_evaluate_counts_each_reward_functions_failures() -> None:
    prompts = [Prompt(id=f"e{k}", text=f"{k}+1=", input_ids=[1]) for k in range(3)]
    scorer = LocalScorer([RewardFn("exact_numeric", exact_numeric, 1.0)])
    done = evaluate(_Generator(), scorer, prompts, max_new_tokens=2, temperature=0.0, batch_size=2)
    assert done.failed == {"exact_numeric": 3.0}
    assert done.metrics[keys.eval_key(keys.REWARD_ERRORS)] == 3.0
    assert [r.reward_error.split(":")[0] for r in done.rollouts] == ["exact_numeric"] * 3


def test_the_eval_line_says_which_reward_failed_after_its_first_message() -> None:
    failed = [_rollout(error=MISSING)] * 4
    metrics = {keys.EVAL_REWARD_MEAN: float("nan"), keys.eval_key(keys.REWARD_ERRORS): 4.0}
    run = SimpleNamespace(step=3, evaluation=lambda: Evaluated(metrics, failed, {"exact_numeric": 4.0}),
                          source=SimpleNamespace(evaluating=contextlib.nullcontext))
    said: list[str] = []
    assert _eval_metrics(run, SimpleNamespace(print=said.append), RewardErrorWatch(3, said.append)) == metrics
    assert said == [
        f"eval reward error at step 3 (first of its kind, not repeated): {MISSING}",
        "eval at step 3: mean nan  (errors 4 of 4: reward exact_numeric failed on 4)",
    ]


def _empty_step_run(step: int, *, dynamic_sampling: bool, reward_errors: float = 0.0) -> SimpleNamespace:
    """A run whose source gives an empty batch (dynamic sampling kept nothing)."""
    none = torch.zeros(0, 0, dtype=torch.long)
    empty = TrainBatch(input_ids=none, attention_mask=none, prompt_len=0, loss_mask=torch.zeros(0, 0))
    metrics = Aggregator().add({keys.reward_errors_key("f"): Sum(reward_errors)})
    source = SimpleNamespace(next=lambda clock: StepBatch([], [], empty, metrics), after_update=lambda clock: None)
    return SimpleNamespace(
        cfg=SimpleNamespace(log=SimpleNamespace(samples_per_step=None),
                            algo=SimpleNamespace(dynamic_sampling=dynamic_sampling)),
        progress=SimpleNamespace(step=step), source=source, learner=SimpleNamespace(version=0),
        roles=SimpleNamespace(reporting=lambda: []),
    )


def test_a_step_that_learned_nothing_is_warned_about_and_does_not_stop_the_run() -> None:
    said: list[str] = []
    watch = RewardErrorWatch(1, said.append)
    for step in (1, 2, 3):
        metrics = train_step(_empty_step_run(step, dynamic_sampling=True), None, watch=watch)
        assert metrics[keys.LEARN_EMPTY_BATCH] == Sum(1.0)
        watch.check()
    train_step(_empty_step_run(4, dynamic_sampling=True, reward_errors=8.0), None, watch=watch)
    assert said == [
        *(f"warning: step {s}: no group kept a reward spread (dynamic sampling), so the step learned nothing"
          for s in (1, 2, 3)),
        "warning: step 4: no group kept a reward spread (dynamic sampling; 8 reward errors), "
        "so the step learned nothing",
    ]


def test_a_step_whose_every_sample_failed_is_warned_about_once() -> None:
    said: list[str] = []
    watch = RewardErrorWatch(0, said.append)
    watch.observe(1, [_rollout(env_error="env: reset raised OSError: down")] * 2)
    watch.learned_nothing(1, "no sample has a completion token")
    watch.learned_nothing(2, "no sample has a completion token")
    assert said == [
        "environment error at step 1 (first of its kind, not repeated): env: reset raised OSError: down",
        "warning: step 1: the environment failed on all 2 samples, so the step learned nothing "
        "(train.max_reward_error_steps=0: the run goes on)",
        "warning: step 2: no sample has a completion token, so the step learned nothing",
    ]
