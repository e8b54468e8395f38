"""The KL coefficient of a run whose KL penalty is in the reward (``algo.kl_in_reward``)."""

from __future__ import annotations

from dataclasses import dataclass

from rltune.algos import adaptive_kl_coef


@dataclass
class KLCoefficient:
    """``coef`` starts at ``algo.kl_coef``; with a ``target`` it follows the adaptive
    controller of Ziegler et al. (2019) after every batch, else it stays fixed. Its one
    number is saved in checkpoints."""

    coef: float
    target: float | None
    horizon: int

    def observe(self, kl_per_sequence: float, n_samples: int) -> None:
        if self.target is not None:
            self.coef = adaptive_kl_coef(
                self.coef, kl_per_sequence, target=self.target, horizon=self.horizon, n_steps=n_samples
            )
