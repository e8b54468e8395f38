"""Pure math on tensors: masked reductions, advantages, policy, value and preference
losses, KL estimators, importance correction and reward shaping.

Imports torch only. Every function takes tensors and explicit keyword hyper-parameters
and returns tensors or ``(loss, metrics)``.
"""

from rltune.algos.advantages import (
    group_advantages,
    group_baseline,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rltune.algos.correction import importance_weight_metrics, importance_weights
from rltune.algos.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_penalty
from rltune.algos.losses import (
    AGGREGATIONS,
    aggregate_loss,
    gspo_policy_loss,
    loss_denominator,
    ppo_policy_loss,
    sft_loss,
)
from rltune.algos.preference import bradley_terry_loss, dpo_loss, simpo_loss
from rltune.algos.reduce import masked_mean, masked_sum, masked_whiten
from rltune.algos.registry import ALGORITHMS, Algorithm, config_problems
from rltune.algos.shaping import (
    groups_with_spread,
    kl_shaped_rewards,
    last_token_rewards,
    overlong_penalty,
)
from rltune.algos.value import gae, value_loss

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "Algorithm",
    "KL_ESTIMATORS",
    "adaptive_kl_coef",
    "aggregate_loss",
    "bradley_terry_loss",
    "config_problems",
    "dpo_loss",
    "gae",
    "group_advantages",
    "group_baseline",
    "groups_with_spread",
    "gspo_policy_loss",
    "importance_weight_metrics",
    "importance_weights",
    "kl_penalty",
    "kl_shaped_rewards",
    "last_token_rewards",
    "loss_denominator",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sft_loss",
    "simpo_loss",
    "value_loss",
]
