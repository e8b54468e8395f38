"""The algorithms rltune can run, as data: what each needs and which math it uses.

A new algorithm is a new entry here and, at most, a new small function in this package
(see docs/algorithms.md, "Adding an algorithm"). Hyper-parameter defaults that differ by
algorithm (DAPO's clip-higher, GSPO's narrow clip, ...) are presets of the config
(``rltune.config.schema.ALGO_PRESETS``), so several entries share their math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rltune.algos.advantages import group_advantages, group_baseline, reinforce_pp_advantages, rloo_advantages
from rltune.algos.losses import gspo_policy_loss, ppo_policy_loss, sft_loss
from rltune.algos.preference import bradley_terry_loss, dpo_loss, simpo_loss
from rltune.algos.value import gae


@dataclass(frozen=True)
class Algorithm:
    """What the runtime must provide for one algorithm.

    ``online``: it generates rollouts every step (else it learns from a fixed dataset).
    ``needs_reference``: it always needs a frozen reference model (e.g. DPO).
    ``uses_reference_when_kl``: it needs the reference model only for a KL penalty, so the
    runtime loads one exactly when ``kl_coef > 0`` (see ``requires_reference``).
    ``needs_critic``: it trains a value model (PPO with GAE).
    ``advantage``: the advantage estimator, or None when the loss needs no advantages.
    ``baseline``: applied to the sequence rewards before a token-level estimator
    (REINFORCE++ with a group baseline), or None.
    ``loss``: the loss function, ``(... ) -> (loss, metrics)``.
    ``advantage_kwargs(algo_cfg)``: the estimator's hyper-parameters from the ``algo``
    config section. A sequence estimator is called as
    ``advantage(rewards [B], group_size, valid=valid [B], **advantage_kwargs(algo_cfg))``.
    ``loss_kwargs(algo_cfg, max_len)``: an online policy loss's hyper-parameters
    (``max_len`` is ``rollout.max_new_tokens``); it is called as
    ``loss(logprobs, old_logprobs, advantages, mask, is_weights=, denominator=, **kwargs)``.
    """

    name: str
    online: bool
    needs_reference: bool
    uses_reference_when_kl: bool
    needs_critic: bool
    advantage: Callable | None
    loss: Callable
    baseline: Callable | None = None
    advantage_kwargs: Callable[[Any], dict[str, Any]] = lambda cfg: {}
    loss_kwargs: Callable[[Any, int | None], dict[str, Any]] = lambda cfg, max_len: {}

    def requires_reference(self, kl_coef: float) -> bool:
        """Whether a reference model must be loaded for this ``kl_coef``."""
        return self.needs_reference or (self.uses_reference_when_kl and kl_coef > 0)


def ppo_loss_kwargs(cfg: Any, max_len: int | None) -> dict[str, Any]:
    """``ppo_policy_loss``'s keys of the ``algo`` section."""
    return dict(
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        aggregation=cfg.aggregation, max_len=max_len,
    )


def gspo_loss_kwargs(cfg: Any, max_len: int | None) -> dict[str, Any]:
    """``gspo_policy_loss``'s keys of the ``algo`` section."""
    return dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high)


def group_advantage_kwargs(cfg: Any) -> dict[str, Any]:
    """``group_advantages``' keys of the ``algo`` section."""
    return {"scale": cfg.adv_scale}


def online_algorithm(
    name: str,
    advantage: Callable,
    loss: Callable = ppo_policy_loss,
    *,
    loss_kwargs: Callable[[Any, int | None], dict[str, Any]] = ppo_loss_kwargs,
    needs_critic: bool = False,
    **kw: Any,
) -> Algorithm:
    """An entry for an algorithm that generates every step; the reference model is loaded
    when ``algo.kl_coef > 0``. ``kw``: ``advantage_kwargs``, ``baseline``."""
    return Algorithm(
        name=name, online=True, needs_reference=False, uses_reference_when_kl=True,
        needs_critic=needs_critic, advantage=advantage, loss=loss, loss_kwargs=loss_kwargs, **kw,
    )


def offline_algorithm(name: str, loss: Callable, *, needs_reference: bool = False) -> Algorithm:
    """An entry for an algorithm that learns from a fixed dataset."""
    return Algorithm(
        name=name, online=False, needs_reference=needs_reference, uses_reference_when_kl=False,
        needs_critic=False, advantage=None, loss=loss,
    )


ALGORITHMS: dict[str, Algorithm] = {
    # GRPO (Shao et al. 2024): group-relative advantages, clipped PPO surrogate, no critic.
    "grpo": online_algorithm("grpo", group_advantages, advantage_kwargs=group_advantage_kwargs),
    # Dr. GRPO (Liu et al. 2025): GRPO without std scaling and with a constant normaliser.
    "dr_grpo": online_algorithm("dr_grpo", group_advantages, advantage_kwargs=group_advantage_kwargs),
    # DAPO (Yu et al. 2025): clip-higher, token-mean loss, dynamic sampling, overlong penalty.
    "dapo": online_algorithm("dapo", group_advantages, advantage_kwargs=group_advantage_kwargs),
    # GSPO (Zheng et al. 2025): group advantages, sequence-level importance ratio.
    "gspo": online_algorithm(
        "gspo", group_advantages, gspo_policy_loss,
        advantage_kwargs=group_advantage_kwargs, loss_kwargs=gspo_loss_kwargs,
    ),
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline within the group.
    "rloo": online_algorithm("rloo", rloo_advantages),
    # REINFORCE++ (Hu 2025): token-level returns whitened over the batch, no critic.
    "reinforce_pp": online_algorithm("reinforce_pp", reinforce_pp_advantages),
    # REINFORCE++ with the group mean subtracted from each reward first.
    "reinforce_pp_baseline": online_algorithm("reinforce_pp_baseline", reinforce_pp_advantages, baseline=group_baseline),
    # PPO (Schulman et al. 2017; Ouyang et al. 2022): a critic and GAE.
    "ppo": online_algorithm("ppo", gae, needs_critic=True),
    # Supervised fine-tuning: token-mean NLL on a fixed dataset.
    "sft": offline_algorithm("sft", sft_loss),
    # DPO (Rafailov et al. 2023) and its IPO / hinge / robust variants: frozen reference.
    "dpo": offline_algorithm("dpo", dpo_loss, needs_reference=True),
    # SimPO (Meng et al. 2024): length-normalised, reference-free.
    "simpo": offline_algorithm("simpo", simpo_loss),
    # Reward model: Bradley-Terry on a scalar head.
    "reward_model": offline_algorithm("reward_model", bradley_terry_loss),
}
