"""What the learner minimises for each loss in ``rltune.algos``: the glue between a
micro-batch of model outputs and the pure loss functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rltune.algos import Algorithm, aggregate_loss, kl_penalty, loss_denominator, masked_mean, ppo_policy_loss, sft_loss
from rltune.config.schema import AlgoConfig
from rltune.data.records import TrainBatch
from rltune.models.logprobs import LogProbOutput

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """``loss(out, micro_batch, denominator)`` returns this micro-batch's share of the
    whole-batch loss; ``denominator(batch)`` is computed once on the whole batch."""

    loss: Callable[[LogProbOutput, TrainBatch, torch.Tensor], tuple[torch.Tensor, Metrics]]
    aggregation: str

    def denominator(self, batch: TrainBatch) -> torch.Tensor:
        return loss_denominator(batch.loss_mask, aggregation=self.aggregation)


def policy_objective(cfg: AlgoConfig) -> Objective:
    """Clipped policy-gradient loss plus, when ``kl_coef > 0``, ``kl_coef`` times the
    KL-to-reference estimate aggregated the same way as the policy loss.

    A batch without ``old_logprobs`` is on-policy and learned once: the old log-probs are
    the current ones, detached, so no second forward pass is spent on them.
    """

    def loss(out: LogProbOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        old = mb.old_logprobs if mb.old_logprobs is not None else out.logprobs.detach()
        total, metrics = ppo_policy_loss(
            out.logprobs, old, mb.advantages, mb.loss_mask,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            aggregation=cfg.aggregation, denominator=denominator,
        )
        if cfg.kl_coef > 0:
            kl = kl_penalty(out.logprobs, mb.ref_logprobs, kind=cfg.kl_kind)
            kl_loss = aggregate_loss(kl, mb.loss_mask, aggregation=cfg.aggregation, denominator=denominator)
            total = total + cfg.kl_coef * kl_loss
            metrics["kl"] = masked_mean(kl.detach(), mb.loss_mask)
        if mb.behaviour_logprobs is not None:
            # engine vs learner log-prob gap on the same tokens: the rollout mismatch
            metrics["logprob_mismatch"] = masked_mean(
                (out.logprobs.detach() - mb.behaviour_logprobs).abs(), mb.loss_mask
            )
        return total, metrics

    return Objective(loss=loss, aggregation=cfg.aggregation)


def sft_objective(cfg: AlgoConfig) -> Objective:
    """Token-mean negative log-likelihood of the completion."""

    def loss(out: LogProbOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return sft_loss(out.logprobs, mb.loss_mask, denominator=denominator)

    return Objective(loss=loss, aggregation="token-mean")


_OBJECTIVES: dict[Callable, Callable[[AlgoConfig], Objective]] = {
    ppo_policy_loss: policy_objective,
    sft_loss: sft_objective,
}


def build_objective(algorithm: Algorithm, cfg: AlgoConfig) -> Objective:
    return _OBJECTIVES[algorithm.loss](cfg)
