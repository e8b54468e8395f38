"""The protocols the loop drives. Each has a local implementation (``runtime/local.py``:
everything in this process) and a Ray one (``runtime/ray/``); ``docs/architecture.md``
shows where each runs.

Weights cross the seam as :data:`Weights`: a dict of tensors in this process, or a handle
the Ray runtime passes between its actors (``WeightsRef``, ``BroadcastWeights``) without
copying them through the driver. Only generators of the same runtime read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Union

import torch

from rltune.data.records import Prompt, Rollout, SamplingParams, TrainBatch
from rltune.metrics.types import MetricLike
from rltune.rewards.scorer import ScoreStats

Weights = Union[dict[str, torch.Tensor], object]
"""The policy's weights as a learner exports them for its runtime's generators."""


class Generator(Protocol):
    """Prompts and sampling parameters to rollouts, with the weights of ``load_weights``."""

    def generate(self, prompts: list[Prompt], params: SamplingParams, *, group_offset: int = 0) -> list[Rollout]: ...
    def load_weights(self, version: int, tensors: Weights | None = None) -> None: ...
    def step_metrics(self) -> dict[str, MetricLike]:
        """What happened since the last call that a step should log (replaced actors,
        weight-load seconds); ``{}`` when nothing does."""
        ...


class Scorer(Protocol):
    """Fills each rollout's rewards in place; ``accuracy_names``: the pass/fail verifiers."""

    @property
    def accuracy_names(self) -> tuple[str, ...]: ...
    def score(self, prompts: dict[str, Prompt], rollouts: list[Rollout]) -> ScoreStats: ...
    def step_metrics(self) -> dict[str, MetricLike]: ...
    def close(self) -> None: ...


class Checkpointed(Protocol):
    """A trained role whose state a checkpoint carries, keys prefixed by ``prefix``
    (``""`` for the policy, ``"critic_"`` for PPO's critic)."""

    def checkpoint_state(self, prefix: str) -> tuple[dict, dict]: ...
    def load_checkpoint_state(self, tensors: dict, meta: dict, path: Path, prefix: str) -> None: ...


class Learner(Checkpointed, Protocol):
    """The policy (or a preference method's model) and its optimizer."""

    @property
    def version(self) -> int:
        """Optimizer steps taken (restored by a checkpoint)."""
        ...

    @property
    def writes_shards(self) -> bool:
        """Whether its checkpoint part is written in shards by its ranks (a learner laid out
        over a mesh): its ``checkpoint_state`` then takes the checkpoint's directory."""
        ...

    def step(self, batch: TrainBatch) -> dict[str, MetricLike]: ...
    def logprobs(self, batch: TrainBatch) -> torch.Tensor: ...
    def export_weights(self) -> Weights: ...
    def fetch_weights(self) -> dict[str, torch.Tensor]:
        """The full weights here, in this process (exports, held-out evaluation)."""
        ...

    def pair_outputs(self, batch: TrainBatch, field: str, *, adapters_off: bool = False) -> torch.Tensor:
        """A preference pair batch scored without gradients by the learner's own ranks
        (:class:`~rltune.learner.pair_scoring.PairScorer`): DPO's reference log-probs and
        held-out preference metrics, with no copy of the model in this process."""
        ...

    def weights_fingerprint(self) -> str:
        """:func:`~rltune.learner.pair_scoring.weights_fingerprint` of the current weights
        (a sharded learner's: of its ranks' shards)."""
        ...

    def step_metrics(self) -> dict[str, MetricLike]: ...


class Reference(Protocol):
    """The frozen starting policy, for the KL term."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` log-probs of ``batch``'s completions."""
        ...

    def fingerprint(self) -> str | None:
        """:func:`~rltune.checkpoint.model.frozen_fingerprint` of its weights, which a
        checkpoint records so that a resume onto other weights at ``model.path`` is refused;
        None when the policy's own checkpoint covers them (LoRA's base with adapters off)."""
        ...


class Critic(Checkpointed, Protocol):
    """PPO's value model and its optimizer."""

    def step(self, batch: TrainBatch) -> dict[str, MetricLike]: ...
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, C]`` value estimates before each completion token."""
        ...


class Streams(Protocol):
    """The RNG streams a checkpoint carries besides the global ones. ``generators`` is
    read when a checkpoint is written and its states set in place when one is restored,
    after which ``restored()`` hands them to where they live (other processes)."""

    @property
    def generators(self) -> dict[str, torch.Generator]: ...
    def restored(self) -> None: ...
