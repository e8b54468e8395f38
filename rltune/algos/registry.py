"""The algorithms rltune can run, as data: what each needs and which math it uses.

A new algorithm is a new entry here and, at most, a new small function in this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rltune.algos.advantages import group_advantages
from rltune.algos.losses import ppo_policy_loss, sft_loss


@dataclass(frozen=True)
class Algorithm:
    """What the runtime must provide for one algorithm.

    ``online``: it generates rollouts every step (else it learns from a fixed dataset).
    ``needs_reference``: it always needs a frozen reference model (e.g. DPO).
    ``uses_reference_when_kl``: it needs the reference model only for a KL penalty, so the
    runtime loads one exactly when ``kl_coef > 0`` (see ``requires_reference``).
    ``needs_critic``: it trains a value model (PPO with GAE).
    ``advantage``: the advantage estimator, or None when the loss needs no advantages.
    ``loss``: the loss function, ``(... ) -> (loss, metrics)``.
    """

    name: str
    online: bool
    needs_reference: bool
    uses_reference_when_kl: bool
    needs_critic: bool
    advantage: Callable | None
    loss: Callable

    def requires_reference(self, kl_coef: float) -> bool:
        """Whether a reference model must be loaded for this ``kl_coef``."""
        return self.needs_reference or (self.uses_reference_when_kl and kl_coef > 0)


ALGORITHMS: dict[str, Algorithm] = {
    # GRPO (Shao et al. 2024): group-relative advantages, clipped PPO surrogate, no critic.
    "grpo": Algorithm(
        name="grpo",
        online=True,
        needs_reference=False,
        uses_reference_when_kl=True,
        needs_critic=False,
        advantage=group_advantages,
        loss=ppo_policy_loss,
    ),
    # Supervised fine-tuning: token-mean NLL on a fixed dataset.
    "sft": Algorithm(
        name="sft",
        online=False,
        needs_reference=False,
        uses_reference_when_kl=False,
        needs_critic=False,
        advantage=None,
        loss=sft_loss,
    ),
}
