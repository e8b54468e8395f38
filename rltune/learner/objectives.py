"""What the learner minimises for each loss in ``rltune.algos``: the glue between a
micro-batch of model outputs and the pure loss functions."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from rltune.algos import (
    Algorithm,
    aggregate_loss,
    importance_weight_metrics,
    importance_weights,
    kl_penalty,
    loss_denominator,
    masked_mean,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)
from rltune.algos.registry import ppo_loss_kwargs
from rltune.config.schema import AlgoConfig
from rltune.data.records import TrainBatch, VisionInputs
from rltune.metrics import keys
from rltune.metrics.types import Sum
from rltune.models.logprobs import LogProbOutput, completion_logprobs
from rltune.models.value import ValueOutput, value_forward
from rltune.models.vision import batch_vision_inputs

Metrics = dict[str, torch.Tensor]


def logprob_forward(
    model: torch.nn.Module, mb: TrainBatch, *, temperature: float, router_logits: bool,
    with_entropy: bool = True,
) -> LogProbOutput:
    """The policy's per-token log-probs (and, for the train step's metrics, entropy) of
    ``mb``'s completions; an MoE batch's recorded routes go along (routing replay), and a
    vision-language batch's pixel inputs."""
    return completion_logprobs(
        model, mb.input_ids, mb.attention_mask, mb.prompt_len,
        temperature=temperature, with_entropy=with_entropy, output_router_logits=router_logits,
        routes=mb.routes, vision=batch_vision(mb),
    )


def batch_vision(mb: TrainBatch) -> VisionInputs | None:
    """The pixel inputs of ``mb``'s rows, concatenated in row order (None: no images)."""
    return None if mb.vision is None else batch_vision_inputs(mb.vision)


logprobs_only = partial(logprob_forward, with_entropy=False)
"""The forward of no-grad passes (old and reference log-probs): no entropy to compute."""



def through_forward(model: torch.nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(module, *args)`` run as ``model``'s forward, for a forward that reads the
    module's parts rather than calling it (a reward model's head on the last token).

    Called through ``model(...)``, the call passes the hooks a distributed wrapper relies
    on: DDP's (without its forward, the backward would not all-reduce) and FSDP2's root
    (which gathers the unsharded top-level weights). ``model`` is the module itself or a
    DDP wrapper around it (``fn`` then gets the wrapped module)."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    own = module.__dict__.get("forward")
    module.forward = lambda *a: fn(module, *a)
    try:
        return model(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own

@dataclass(frozen=True)
class Objective:
    """What one learner minimises, in three parts.

    ``forward(model, micro_batch, temperature=, router_logits=)`` runs the model; its
    output has an ``aux_loss`` attribute (an MoE router loss, or None).
    ``loss(out, micro_batch, denominator)`` returns this micro-batch's share of the
    whole-batch loss and its metrics; ``denominator(batch)`` is computed once on the whole
    batch. ``unit`` rows in a row stay in one micro-batch (2 for chosen/rejected pairs).
    """

    loss: Callable[[Any, TrainBatch, torch.Tensor], tuple[torch.Tensor, Metrics]]
    aggregation: str
    forward: Callable[..., Any] = logprob_forward
    unit: int = 1
    count: Callable[[TrainBatch], torch.Tensor] | None = None
    """The whole-batch normaliser when it is not ``loss_denominator`` of the loss mask."""
    weight: Callable[[TrainBatch], torch.Tensor] | None = None
    """How much a micro-batch's metrics weigh in the step's average; None: its loss tokens."""

    def metric_weight(self, mb: TrainBatch) -> torch.Tensor:
        return self.weight(mb) if self.weight is not None else mb.loss_mask.sum()

    def denominator(self, batch: TrainBatch) -> torch.Tensor:
        if self.count is not None:
            return self.count(batch)
        return loss_denominator(batch.loss_mask, aggregation=self.aggregation)


def policy_objective(
    cfg: AlgoConfig,
    *,
    policy_loss: Callable = ppo_policy_loss,
    loss_kwargs: Callable[[AlgoConfig, int | None], dict[str, Any]] = ppo_loss_kwargs,
    max_len: int | None = None,
) -> Objective:
    """A clipped policy-gradient loss (``ppo_policy_loss`` or ``gspo_policy_loss``) plus,
    when ``kl_coef > 0`` and the KL is not already in the reward, ``kl_coef`` times the
    KL-to-reference estimate aggregated the same way as the policy loss.

    A batch without ``old_logprobs`` is on-policy and learned once: the old log-probs are
    the current ones, detached, so no second forward pass is spent on them. With
    ``importance_correction`` the loss is weighted by the truncated or masked ratio of
    those old log-probs to the generating engine's (``behaviour_logprobs``).
    ``loss_kwargs(cfg, max_len)`` gives the loss's hyper-parameters (the registry entry's);
    ``max_len`` is the constant of the "seq-mean-token-sum-norm" aggregation.
    """
    hyper = loss_kwargs(cfg, max_len)
    kl_in_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward

    def loss(out: LogProbOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        old = mb.old_logprobs if mb.old_logprobs is not None else out.logprobs.detach()
        is_weights, correction = None, {}
        if cfg.importance_correction != "none" and mb.behaviour_logprobs is not None:
            is_weights = importance_weights(
                old, mb.behaviour_logprobs, mb.loss_mask, mode=cfg.importance_correction, cap=cfg.importance_cap
            )
            correction = importance_weight_metrics(is_weights, old, mb.behaviour_logprobs, mb.loss_mask)
        total, metrics = policy_loss(
            out.logprobs, old, mb.advantages, mb.loss_mask,
            is_weights=is_weights, denominator=denominator, **hyper,
        )
        metrics.update(correction)
        if kl_in_loss:
            metrics[keys.loss_part_key("policy")] = Sum(total.detach().float())
            kl = kl_penalty(out.logprobs, mb.ref_logprobs, kind=cfg.kl_kind)
            kl_loss = aggregate_loss(
                kl, mb.loss_mask, aggregation=cfg.aggregation, denominator=denominator, max_len=max_len
            )
            total = total + cfg.kl_coef * kl_loss
            metrics[keys.KL] = masked_mean(kl.detach(), mb.loss_mask)
            metrics[keys.loss_part_key("kl")] = Sum(cfg.kl_coef * kl_loss.detach().float())
        metrics[keys.ENTROPY] = masked_mean(out.entropy, mb.loss_mask)
        if mb.behaviour_logprobs is not None:
            # engine vs learner log-prob gap on the same tokens: the rollout mismatch
            metrics[keys.LOGPROB_MISMATCH] = masked_mean(
                (out.logprobs.detach() - mb.behaviour_logprobs).abs(), mb.loss_mask
            )
        return total, metrics

    def count(batch: TrainBatch) -> torch.Tensor:
        return loss_denominator(batch.loss_mask, aggregation=cfg.aggregation, max_len=max_len)

    return Objective(loss=loss, aggregation=cfg.aggregation, count=count)


def value_objective(cfg: AlgoConfig) -> Objective:
    """PPO's critic: ``value_loss`` against ``returns``, clipped around the values the
    batch was scored with (``values``), token-mean over the policy's tokens."""

    def loss(out: ValueOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        return value_loss(out.values, mb.values, mb.returns, mb.loss_mask, clip=cfg.value_clip, denominator=denominator)

    return Objective(loss=loss, aggregation="token-mean", forward=value_forward)


def sft_objective(cfg: AlgoConfig) -> Objective:
    """Token-mean negative log-likelihood of the completion."""

    def loss(out: LogProbOutput, mb: TrainBatch, denominator: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        loss_, metrics = sft_loss(out.logprobs, mb.loss_mask, denominator=denominator)
        metrics[keys.ENTROPY] = masked_mean(out.entropy, mb.loss_mask)
        return loss_, metrics

    return Objective(loss=loss, aggregation="token-mean")


def build_objective(algorithm: Algorithm, cfg: AlgoConfig, *, max_len: int | None = None) -> Objective:
    """The learner's objective for ``algorithm``; ``max_len`` is ``rollout.max_new_tokens``."""
    if algorithm.online:
        return policy_objective(cfg, policy_loss=algorithm.loss, loss_kwargs=algorithm.loss_kwargs, max_len=max_len)
    if algorithm.loss is sft_loss:
        return sft_objective(cfg)
    raise ValueError(f"algorithm {algorithm.name!r} trains with its own objective, not the policy learner's")
