"""make_experience for each estimator family, on hand-built rollouts with a stand-in
learner, critic and reference whose outputs are fixed tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig
from rltune.data.records import Rollout
from rltune.runtime.experience import make_experience
from rltune.runtime.kl import KLCoefficient

PAD = 0
# two prompts x two samples; completions of 2, 3, 1, 2 tokens; sample 3 has no reward
REWARDS = [1.0, 0.0, 0.5, None]
LENGTHS = [2, 3, 1, 2]


def rollouts() -> list[Rollout]:
    return [
        Rollout(
            prompt_id=f"p{i // 2}", group=i // 2, prompt_ids=torch.tensor([5, 6]),
            completion_ids=torch.arange(10, 10 + n), completion_logprobs=torch.full((n,), -1.0),
            loss_mask=torch.ones(n), text="x" * n, finish_reason="stop", policy_version=0, reward=r,
        )
        for i, (r, n) in enumerate(zip(REWARDS, LENGTHS))
    ]


MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)


def fake_run(name: str, **algo) -> SimpleNamespace:
    cfg = SimpleNamespace(algo=AlgoConfig(name=name, group_size=2, **algo))
    return SimpleNamespace(
        cfg=cfg, algorithm=ALGORITHMS[name], reference=None, critic=None, kl=None,
        learner=SimpleNamespace(logprobs=lambda batch: torch.full(batch.loss_mask.shape, -1.0)),
    )


def experience(run: SimpleNamespace, samples: list[Rollout]):
    return make_experience(
        samples, algorithm=run.algorithm, algo=run.cfg.algo, pad_id=PAD, policy_logprobs=run.learner.logprobs,
        reference=run.reference, critic=run.critic, kl=run.kl,
    )


def whiten(x: list[float]) -> list[float]:
    mean = sum(x) / len(x)
    var = sum((v - mean) ** 2 for v in x) / len(x)
    return [(v - mean) / (var + 1e-8) ** 0.5 for v in x]


def test_loss_mask_drops_the_unscored_sample() -> None:
    batch, _ = experience(fake_run("rloo"), rollouts())
    assert torch.equal(batch.loss_mask, MASK)


def test_rloo_advantage_is_reward_minus_the_other_sample() -> None:
    batch, _ = experience(fake_run("rloo"), rollouts())
    # group 0: 1 - 0 and 0 - 1; group 1: one valid sample, no baseline -> 0
    assert batch.advantages[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0]


def test_reinforce_pp_returns_are_the_score_at_every_token_then_whitened() -> None:
    # gamma 1: every token's return is its sequence's score (0 for the unscored one,
    # which is masked out anyway). Masked tokens: 1, 1 | 0, 0, 0 | 0.5
    batch, _ = experience(fake_run("reinforce_pp"), rollouts())
    expected = whiten([1.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    torch.testing.assert_close(batch.advantages[MASK.bool()], torch.tensor(expected), atol=1e-6, rtol=0)
    assert float(batch.advantages[~MASK.bool()].abs().sum()) == 0.0


def test_reinforce_pp_with_baseline_subtracts_the_group_mean_first() -> None:
    # group 0 mean 0.5: scores 0.5, -0.5; group 1 has one valid sample: 0.5 - 0.5 = 0
    batch, _ = experience(fake_run("reinforce_pp_baseline"), rollouts())
    expected = whiten([0.5, 0.5, -0.5, -0.5, -0.5, 0.0])
    torch.testing.assert_close(batch.advantages[MASK.bool()], torch.tensor(expected), atol=1e-6, rtol=0)


def test_ppo_uses_the_critic_and_gae_with_kl_in_the_reward() -> None:
    run = fake_run("ppo", kl_coef=0.5, kl_in_reward=True, gamma=1.0, lam=1.0)
    run.reference = SimpleNamespace(logprobs=lambda batch: torch.full(batch.loss_mask.shape, -1.5))
    run.critic = SimpleNamespace(values=lambda batch: torch.full(batch.loss_mask.shape, 0.25))
    run.kl = KLCoefficient(coef=0.5, target=None, horizon=1)
    batch, metrics = experience(run, rollouts())
    # k1 = old - ref = -1 - (-1.5) = 0.5 per token; token reward = -0.5 * 0.5 = -0.25, plus
    # the score on the last token. gamma = lam = 1: return_t = sum of rewards from t on.
    # row 0 (score 1, 2 tokens): returns 0.5, 0.75; row 1 (score 0, 3 tokens): -0.75,
    # -0.5, -0.25; row 2 (score 0.5, 1 token): 0.25. Advantages = returns - 0.25.
    returns = [0.5, 0.75, -0.75, -0.5, -0.25, 0.25]
    torch.testing.assert_close(batch.returns[MASK.bool()], torch.tensor(returns), atol=1e-6, rtol=0)
    expected = whiten([r - 0.25 for r in returns])
    torch.testing.assert_close(batch.advantages[MASK.bool()], torch.tensor(expected), atol=1e-6, rtol=0)
    assert metrics["kl"] == pytest.approx(0.5) and metrics["kl_coef"] == 0.5
    assert torch.equal(batch.values, torch.full(MASK.shape, 0.25))


def test_old_logprobs_only_when_the_batch_is_learned_more_than_once() -> None:
    once, _ = experience(fake_run("grpo"), rollouts())
    assert once.old_logprobs is None
    twice, _ = experience(fake_run("grpo", epochs=2), rollouts())
    assert torch.equal(twice.old_logprobs, torch.full(MASK.shape, -1.0))
