"""GRPO experience (make_experience) and rollout_metrics on hand-built rollouts, some without a reward."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig
from rltune.data.records import Rollout
from rltune.metrics.types import histograms, scalars
from rltune.runtime.experience import make_experience, rollout_metrics

PAD = 0
GROUP = 4
EPS = 1e-6  # group_advantages' default, added to the std
# group 0: one missing reward; group 1: all equal; group 2: a single valid reward
REWARDS = [1.0, None, 0.0, 2.0, 0.5, 0.5, 0.5, 0.5, None, None, 3.0, None]
LENGTHS = [3, 5, 2, 4, 1, 6, 3, 2, 4, 4, 5, 1]
FINISH = ["stop", "length", "stop", "stop", "stop", "length", "stop", "stop", "stop", "stop", "length", "stop"]


def rollouts() -> list[Rollout]:
    out = []
    for i, (reward, length, finish) in enumerate(zip(REWARDS, LENGTHS, FINISH)):
        group = i // GROUP
        out.append(
            Rollout(
                prompt_id=f"p{group}",
                group=group,
                prompt_ids=torch.arange(10, 12 + group),  # prompts of 2, 3, 4 tokens
                completion_ids=torch.arange(100 + i, 100 + i + length),
                completion_logprobs=torch.full((length,), -0.1 * (i + 1)),
                loss_mask=torch.ones(length),
                text="x" * length,
                finish_reason=finish,
                policy_version=3,
                reward=reward,
                rewards={"correct": reward, "format": 1.0},
                reward_error=None if reward is not None else "ValueError: no number",
            )
        )
    return out


@pytest.mark.parametrize(
    ("scale", "eps", "group0"),
    [
        # valid rewards {1, 0, 2}: mean 1, sample std sqrt((0 + 1 + 1) / 2) = 1
        ("std", EPS, [0.0, 0.0, -1 / (1 + EPS), 1 / (1 + EPS)]),
        ("std", 1e-4, [0.0, 0.0, -1 / (1 + 1e-4), 1 / (1 + 1e-4)]),  # algo.adv_eps reaches the estimator
        ("none", 1e-4, [0.0, 0.0, -1.0, 1.0]),
    ],
)
def test_missing_reward_is_masked_out_and_left_out_of_the_baseline(scale: str, eps: float, group0) -> None:
    algo = AlgoConfig(group_size=GROUP, adv_scale=scale, adv_eps=eps)
    batch, _ = make_experience(
        rollouts(), algorithm=ALGORITHMS["grpo"], algo=algo, pad_id=PAD,
        policy_logprobs=lambda batch: pytest.fail("a batch learned once needs no old log-probs"),
    )
    valid = [r is not None for r in REWARDS]
    # per-row advantage, constant over the row's tokens; groups 1 and 2 have no signal
    expected = torch.tensor(group0 + [0.0] * 8)
    assert batch.advantages.shape == batch.loss_mask.shape == (12, max(LENGTHS))
    torch.testing.assert_close(batch.advantages, expected[:, None].expand(12, max(LENGTHS)), rtol=0, atol=1e-7)
    for row, (ok, length) in enumerate(zip(valid, LENGTHS)):
        want = [1.0] * length + [0.0] * (max(LENGTHS) - length) if ok else [0.0] * max(LENGTHS)
        assert batch.loss_mask[row].tolist() == want, row
    # the rest of the batch is the plain collation: prompts left-padded to 4 columns
    assert batch.prompt_len == 4
    assert batch.input_ids[0].tolist()[:6] == [PAD, PAD, 10, 11, 100, 101]
    assert batch.versions.tolist() == [3] * 12
    assert batch.behaviour_logprobs[1, :5].tolist() == pytest.approx([-0.2] * 5)
    assert not torch.isnan(batch.advantages).any()


def test_accuracy_is_the_share_of_full_marks_among_scored_samples() -> None:
    # "correct" scored 8 samples: 1.0, 0.0, 2.0, 0.5 x4, 3.0 -> 3 at or above 1.0
    metrics = scalars(rollout_metrics(rollouts(), GROUP, accuracy=("correct",)))
    assert metrics["accuracy/correct"] == 3 / 8 and metrics["accuracy"] == 3 / 8
    # both must be right: "format" is 1.0 everywhere, so the joint share is the same
    both = scalars(rollout_metrics(rollouts(), GROUP, accuracy=("correct", "format")))
    assert both["accuracy/format"] == 1.0 and both["accuracy"] == 3 / 8


def test_rollout_metrics_count_errors_and_stay_finite() -> None:
    typed = rollout_metrics(rollouts(), GROUP)
    metrics = scalars(typed)
    valid = torch.tensor([r for r in REWARDS if r is not None])
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert histograms(typed) == {"hist/reward": [r for r in REWARDS if r is not None],
                                 "hist/length": [float(n) for n in LENGTHS]}
    assert not any(k.startswith("accuracy") for k in metrics)  # no verifier named
    assert metrics["reward/errors"] == 4.0
    assert metrics["reward/mean"] == pytest.approx(8.0 / 8)
    assert metrics["reward/std"] == pytest.approx(float(valid.std()))
    assert metrics["reward/correct"] == pytest.approx(1.0)
    assert metrics["reward/format"] == 1.0
    assert metrics["length/mean"] == pytest.approx(sum(LENGTHS) / 12)
    assert metrics["length/max"] == 6.0
    assert metrics["length/clipped_frac"] == pytest.approx(3 / 12)
    # group 0 has spread 2 among its valid rewards; group 1 none; group 2 a single valid
    # reward, which gives no baseline (all its advantages are 0): 2 of 3 groups give no signal
    assert metrics["groups/zero_std_frac"] == pytest.approx(2 / 3)
