"""Pure math on tensors: masked reductions, advantages, policy losses, KL estimators.

Imports torch only. Every function takes tensors and explicit keyword hyper-parameters
and returns tensors or ``(loss, metrics)``.
"""

from rltune.algos.advantages import group_advantages
from rltune.algos.kl import KL_ESTIMATORS, kl_penalty
from rltune.algos.losses import AGGREGATIONS, aggregate_loss, loss_denominator, ppo_policy_loss, sft_loss
from rltune.algos.reduce import masked_mean, masked_sum, masked_whiten
from rltune.algos.registry import ALGORITHMS, Algorithm

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "Algorithm",
    "KL_ESTIMATORS",
    "aggregate_loss",
    "group_advantages",
    "kl_penalty",
    "loss_denominator",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "ppo_policy_loss",
    "sft_loss",
]
