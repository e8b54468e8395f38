"""From scored rollouts to a TrainBatch: rewards, reference and old log-probs, values,
advantages — and the rollout statistics of a step.

Which estimator runs is the algorithm's ``advantage`` entry (``rltune.algos.registry``):
sequence-level estimators (GRPO's group advantages, RLOO, any new one following their
convention) give one value per sample; the token-level ones (REINFORCE++, PPO's GAE)
work on per-token rewards, the sequence's score
on its last token minus, with ``algo.kl_in_reward``, ``kl_coef`` times the k1 KL.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from rltune.algos import (
    Algorithm,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    last_token_rewards,
    masked_mean,
    masked_whiten,
    reinforce_pp_advantages,
)
from rltune.config.schema import AlgoConfig
from rltune.data.collate import collate_rollouts
from rltune.data.records import Rollout, TrainBatch
from rltune.metrics import keys
from rltune.metrics.types import Histogram, MetricLike
from rltune.runtime.kl import KLCoefficient
from rltune.runtime.protocols import Critic, Reference


def rewards_tensor(rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards [B], valid [B] bool)``; a missing reward is NaN and not valid."""
    rewards = torch.tensor(
        [r.reward if r.reward is not None else float("nan") for r in rollouts], dtype=torch.float32
    )
    return rewards, ~torch.isnan(rewards)


# Estimators of per-token advantages; every other estimator is sequence-level (registry).
_TOKEN_ESTIMATORS = (gae, reinforce_pp_advantages)


def _masked_batch(rollouts: Sequence[Rollout], valid: torch.Tensor, pad_id: int) -> TrainBatch:
    batch = collate_rollouts(rollouts, pad_id)
    batch.loss_mask = batch.loss_mask * valid[:, None].float()
    return batch


def make_experience(
    rollouts: Sequence[Rollout],
    *,
    algorithm: Algorithm,
    algo: AlgoConfig,
    pad_id: int,
    policy_logprobs: Callable[[TrainBatch], torch.Tensor],
    reference: Reference | None = None,
    critic: Critic | None = None,
    kl: KLCoefficient | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """The TrainBatch the learner steps on, and the metrics of making it.

    Samples without a reward are left out of every baseline and of the loss (loss-mask 0).
    Old log-probs (``policy_logprobs``, the learner's) are computed only when the batch is
    learned more than once (PPO epochs, mini-batches) or the KL enters the reward;
    otherwise the loss takes the current ones, detached, at no extra cost. ``reference``
    gives the KL term's log-probs, ``critic`` GAE's values, ``kl`` the coefficient of the
    KL in the reward (``algo.kl_in_reward``).
    """
    rewards, valid = rewards_tensor(rollouts)
    batch = _masked_batch(rollouts, valid, pad_id)
    metrics: dict[str, float] = {}
    if reference is not None:
        batch.ref_logprobs = reference.logprobs(batch)
    if algo.epochs * algo.minibatches > 1 or (algo.kl_in_reward and algo.kl_coef > 0):
        batch.old_logprobs = policy_logprobs(batch)
    estimator = algorithm.advantage
    if estimator not in _TOKEN_ESTIMATORS:
        advantages = estimator(rewards, algo.group_size, valid=valid, **algorithm.advantage_kwargs(algo))
        batch.advantages = advantages[:, None].expand_as(batch.loss_mask)
        return batch, metrics
    scores = torch.where(valid, rewards, torch.zeros_like(rewards))
    if algorithm.baseline is not None:
        scores = algorithm.baseline(rewards, algo.group_size, valid=valid)
    token_rewards = _token_rewards(algo, kl, batch, scores, metrics)
    if estimator is gae:
        if critic is None:
            raise ValueError(f"algo.name={algo.name}: GAE needs a critic")
        batch.values = critic.values(batch)
        advantages, batch.returns = gae(token_rewards, batch.values, batch.loss_mask, gamma=algo.gamma, lam=algo.lam)
        batch.advantages = masked_whiten(advantages, batch.loss_mask)
    else:
        batch.advantages = reinforce_pp_advantages(token_rewards, batch.loss_mask, gamma=algo.gamma)
    return batch, metrics


def _token_rewards(
    algo: AlgoConfig, kl: KLCoefficient | None, batch: TrainBatch, scores: torch.Tensor, metrics: dict[str, float]
) -> torch.Tensor:
    """Each sequence's score on its last token, minus ``kl_coef * k1`` per token when the
    KL is in the reward (``algo.kl_in_reward``)."""
    if not (algo.kl_in_reward and algo.kl_coef > 0):
        return last_token_rewards(scores, batch.loss_mask)
    if kl is None:
        raise ValueError("algo.kl_in_reward needs the run's KL coefficient")
    penalty = kl_penalty(batch.old_logprobs, batch.ref_logprobs, kind="k1")
    coef = kl.coef
    metrics[keys.KL] = float(masked_mean(penalty, batch.loss_mask))
    metrics[keys.KL_COEF] = coef
    # the adaptive controller targets the KL of a whole sequence (Ziegler et al. 2019)
    kl.observe(float((penalty * batch.loss_mask).sum() / batch.loss_mask.any(1).sum().clamp(min=1)), len(batch))
    return kl_shaped_rewards(scores, penalty, batch.loss_mask, kl_coef=coef)


def rollout_metrics(
    rollouts: Sequence[Rollout], group_size: int, *, accuracy: Collection[str] = ()
) -> dict[str, MetricLike]:
    """Reward, length and group statistics of one step's rollouts, with the histograms
    ``hist/reward`` (scored samples) and ``hist/length``. ``accuracy``: the names of the
    pass/fail verifiers among the rewards (:func:`accuracy_metrics`)."""
    rewards, valid = rewards_tensor(rollouts)
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)
    clipped = torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.float32)
    metrics = {
        keys.REWARD_MEAN: _mean(rewards[valid]),
        keys.REWARD_STD: float(rewards[valid].std()) if int(valid.sum()) > 1 else 0.0,
        keys.REWARD_ERRORS: float((~valid).sum()) - sum(r.dropped for r in rollouts),
        keys.LENGTH_MEAN: float(lengths.mean()),
        keys.LENGTH_MAX: float(lengths.max()),
        keys.LENGTH_CLIPPED_FRAC: float(clipped.mean()),
    }
    if group_size > 1:
        # spread over each group's valid rewards only (a missing one is NaN and would make
        # the whole group's max NaN); a group with under two valid rewards has no
        # baseline, hence zero advantages, and counts as zero-std
        grouped, ok = rewards.view(-1, group_size), valid.view(-1, group_size)
        top = torch.where(ok, grouped, -torch.inf).amax(1)
        bottom = torch.where(ok, grouped, torch.inf).amin(1)
        spread = torch.where(ok.sum(1) >= 2, top - bottom, 0.0)
        metrics[keys.GROUPS_ZERO_STD_FRAC] = float((spread == 0).float().mean())
    if any(r.turns is not None for r in rollouts):
        metrics.update(episode_metrics(rollouts))
    names = {name for r in rollouts for name in r.rewards}
    for name in sorted(names):
        values = torch.tensor(
            [v for r in rollouts if (v := r.rewards.get(name)) is not None], dtype=torch.float32
        )
        metrics[keys.reward_key(name)] = _mean(values)
    metrics.update(accuracy_metrics(rollouts, accuracy))
    metrics[keys.HIST_REWARD] = Histogram(rewards[valid])
    metrics[keys.HIST_LENGTH] = Histogram(lengths)
    return metrics


def accuracy_metrics(rollouts: Sequence[Rollout], verifiers: Collection[str]) -> dict[str, float]:
    """``accuracy/NAME``: the share of the samples verifier NAME scored that it scored
    1.0 (correct); ``accuracy``: the share of samples every verifier scored that all of
    them scored 1.0. Nothing when there is no verifier."""
    metrics: dict[str, float] = {}
    correct_all = []
    for r in rollouts:
        values = [r.rewards.get(name) for name in verifiers]
        if verifiers and all(v is not None for v in values):
            correct_all.append(all(v >= 1.0 for v in values))
    for name in sorted(verifiers):
        scored = [v >= 1.0 for r in rollouts if (v := r.rewards.get(name)) is not None]
        metrics[keys.accuracy_key(name)] = sum(scored) / len(scored) if scored else float("nan")
    if verifiers:
        metrics[keys.ACCURACY] = sum(correct_all) / len(correct_all) if correct_all else float("nan")
    return metrics


def episode_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Multi-turn episodes: ``env/turns`` (the model's turns per episode),
    ``env/tool_calls`` (tool turns per episode), ``env/tool_call_frac`` (episodes with at
    least one), ``env/masked_frac`` (share of completion tokens not trained on) and
    ``env/errors`` (episodes whose environment failed)."""
    turns = [r.turns or [] for r in rollouts]
    tool = torch.tensor([sum(t["role"] == "tool" for t in ts) for ts in turns], dtype=torch.float32)
    model = torch.tensor([sum(t["role"] == "assistant" for t in ts) for ts in turns], dtype=torch.float32)
    masks = [r.loss_mask for r in rollouts]
    total = sum(len(m) for m in masks)
    return {
        keys.ENV_TURNS: float(model.mean()),
        keys.ENV_TOOL_CALLS: float(tool.mean()),
        keys.ENV_TOOL_CALL_FRAC: float((tool > 0).float().mean()),
        keys.ENV_MASKED_FRAC: float(sum(len(m) - float(m.sum()) for m in masks) / total) if total else 0.0,
        keys.ENV_ERRORS: float(sum(r.env_error is not None for r in rollouts)),
    }


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else float("nan")
