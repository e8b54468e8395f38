"""The policy objective's glue: which loss, which denominator, the importance weights and
the KL term, checked against direct calls of the pure functions."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.algos import ALGORITHMS, gspo_policy_loss, ppo_policy_loss
from rltune.config.schema import AlgoConfig
from rltune.data.records import TrainBatch
from rltune.learner.objectives import build_objective
from rltune.models.logprobs import LogProbOutput

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
LOGP = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, -0.1, -0.3]])
BEHAVIOUR = torch.tensor([[-1.0 - math.log(3.0), -0.5, 0.0], [-2.0, -0.1 + math.log(2.0), -0.3]])


def batch() -> TrainBatch:
    return TrainBatch(
        input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
        prompt_len=2, loss_mask=MASK, advantages=torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]]),
        behaviour_logprobs=BEHAVIOUR,
    )


def out(logp: torch.Tensor) -> LogProbOutput:
    return LogProbOutput(logprobs=logp, entropy=torch.zeros_like(logp))


def test_token_truncated_importance_weights_scale_each_token() -> None:
    # ratios old/behaviour: row 0 token 0: exp(log 3) = 3 -> capped at 2; row 1 token 1:
    # exp(-log 2) = 0.5; every other token 1.
    cfg = AlgoConfig(importance_correction="token-truncate", importance_cap=2.0)
    objective = build_objective(ALGORITHMS["grpo"], cfg)
    b = batch()
    logp = LOGP.clone().requires_grad_(True)
    loss, metrics = objective.loss(out(logp), b, objective.denominator(b))
    weights = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.5, 1.0]])
    expected, _ = ppo_policy_loss(LOGP, LOGP, b.advantages, MASK, is_weights=weights)
    # on-policy: ratio 1, per-token loss -A * w; token-mean over 5 tokens
    assert float(expected) == pytest.approx(-(2 * 1 + 1 * 1 - 0.5 * 1 - 0.5 * 0.5 - 0.5 * 1) / 5)
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-7)
    assert float(metrics["is_weight_max"]) == 2.0


def test_without_correction_the_weights_are_one() -> None:
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig())
    b = batch()
    loss, metrics = objective.loss(out(LOGP), b, objective.denominator(b))
    assert float(loss) == pytest.approx(-(1 + 1 - 0.5 * 3) / 5, abs=1e-7)
    assert "is_weight_max" not in metrics
    assert float(metrics["logprob_mismatch"]) == pytest.approx((math.log(3.0) + math.log(2.0)) / 5, abs=1e-6)


def test_dr_grpo_divides_by_sequences_times_max_new_tokens() -> None:
    cfg = AlgoConfig(name="dr_grpo", adv_scale="none", aggregation="seq-mean-token-sum-norm")
    objective = build_objective(ALGORITHMS["dr_grpo"], cfg, max_len=8)
    b = batch()
    assert float(objective.denominator(b)) == 2 * 8
    loss, _ = objective.loss(out(LOGP), b, objective.denominator(b))
    assert float(loss) == pytest.approx(-(1 + 1 - 0.5 * 3) / 16, abs=1e-7)


def test_gspo_uses_the_sequence_loss_and_counts_sequences() -> None:
    cfg = AlgoConfig(name="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean")
    objective = build_objective(ALGORITHMS["gspo"], cfg)
    b = batch()
    assert float(objective.denominator(b)) == 2
    loss, _ = objective.loss(out(LOGP), b, objective.denominator(b))
    expected, _ = gspo_policy_loss(LOGP, LOGP, b.advantages, MASK, clip_low=3e-4, clip_high=4e-4)
    assert float(loss) == pytest.approx(float(expected)) == pytest.approx(-(1 - 0.5) / 2)


def test_kl_in_the_reward_adds_no_loss_term() -> None:
    in_loss = build_objective(ALGORITHMS["grpo"], AlgoConfig(kl_coef=0.5, kl_kind="k1"))
    in_reward = build_objective(ALGORITHMS["ppo"], AlgoConfig(name="ppo", kl_coef=0.5, kl_in_reward=True))
    b = batch()
    b.ref_logprobs = LOGP - 1.0  # k1 = 1 on every token
    with_kl, metrics = in_loss.loss(out(LOGP), b, in_loss.denominator(b))
    without, _ = in_reward.loss(out(LOGP), b, in_reward.denominator(b))
    assert float(with_kl) == pytest.approx(float(without) + 0.5 * 1.0, abs=1e-7)
    assert float(metrics["kl"]) == pytest.approx(1.0)


def test_offline_losses_are_not_policy_objectives() -> None:
    with pytest.raises(ValueError, match="own objective"):
        build_objective(ALGORITHMS["dpo"], AlgoConfig(name="dpo"))
