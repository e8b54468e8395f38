"""Where each step's batch comes from: one protocol, three implementations.

- :class:`OnPolicy` (``runtime.max_staleness: 0``): draw, generate and score with the
  newest policy, make the experience; after the update the generator loads the new policy.
- :class:`AheadOfLearner` (``max_staleness: k > 0``): take the oldest batch the producer
  (:class:`~rltune.runtime.rollouts.AsyncRollouts`) generated and scored ahead, make the
  experience; after the update the new policy is published to the producer.
- :class:`Offline` (SFT, preference methods): draw and collate.

The loop calls ``next`` before the update and ``after_update`` after it, whatever the
source; ``evaluating`` and ``paused`` hold a producer still while the loop evaluates or
writes a checkpoint, and a checkpoint carries what ``queued`` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rltune.algos import Algorithm
from rltune.checkpoint.rollouts import QueuedBatch
from rltune.config.schema import AlgoConfig
from rltune.data.records import Prompt, Rollout, TrainBatch
from rltune.metrics import keys
from rltune.metrics.types import Aggregator, Max, Metric
from rltune.runtime.clock import StepClock
from rltune.runtime.collect import Collector
from rltune.runtime.experience import make_experience, rollout_metrics
from rltune.runtime.parts import RunData, RunRoles
from rltune.runtime.rollouts import AsyncRollouts


@dataclass
class StepBatch:
    """One step's batch: its prompts, the rollouts it was made from (empty offline), the
    metrics of making it, and the seconds the learner waited for it (a producer ahead)."""

    prompts: list[Prompt]
    rollouts: list[Rollout]
    batch: TrainBatch
    metrics: Aggregator
    learner_wait_s: float | None = None
    dropped: list[Rollout] = field(default_factory=list)
    """Scored rollouts left out of the batch (dynamic sampling's groups without a spread):
    their reward errors are the step's too."""


class BatchSource(Protocol):
    max_ahead: int
    """Batches that may be made before the learner asks for them (0: none)."""

    def next(self, clock: StepClock) -> StepBatch: ...
    def after_update(self, clock: StepClock) -> None:
        """The learner stepped: its new policy goes to the generator (``time/sync``)."""
        ...

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """Around a held-out evaluation: the generator holds the learner's newest policy."""
        ...

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Around a checkpoint: nothing is drawn or generated meanwhile."""
        ...

    def queued(self) -> list[QueuedBatch]: ...
    def restore(self, batches: list[QueuedBatch], version: int) -> None:
        """Continue from a checkpoint: the batches it saved wait for the learner."""
        ...

    def close(self) -> None: ...


def staleness_metrics(rollouts: list[Rollout], learner_version: int) -> dict[str, Metric]:
    """How many policy versions behind the learner the step's samples were generated:
    ``staleness/mean`` and ``staleness/max`` (0 when generation waits for every update)."""
    if not rollouts:
        return {}
    lags = [learner_version - r.policy_version for r in rollouts]
    return {keys.STALENESS_MEAN: sum(lags) / len(lags), keys.STALENESS_MAX: Max(float(max(lags)))}


@dataclass(frozen=True)
class Experience:
    """Turns a step's scored rollouts into its batch with the run's roles, adding the
    metrics of making it and of the rollouts themselves."""

    algorithm: Algorithm
    algo: AlgoConfig
    pad_id: int
    roles: RunRoles

    def __call__(self, rollouts: list[Rollout], metrics: Aggregator, clock: StepClock) -> TrainBatch:
        if not rollouts:  # DAPO dropped every group: the step learns nothing (learn/empty_batch)
            return _empty_batch()
        r = self.roles
        batch, made = make_experience(
            rollouts, algorithm=self.algorithm, algo=self.algo, pad_id=self.pad_id,
            policy_logprobs=r.learner.logprobs, reference=r.reference, critic=r.critic, kl=r.kl,
        )
        metrics.add(made)
        clock.mark("experience")
        accuracy = r.scorer.accuracy_names if r.scorer is not None else ()
        metrics.add(rollout_metrics(rollouts, self.algo.group_size, accuracy=accuracy))
        metrics.add(staleness_metrics(rollouts, r.learner.version))
        return batch


def _empty_batch() -> TrainBatch:
    """A batch of no rows, which the step reports as ``learn/empty_batch``."""
    none = torch.zeros(0, 0, dtype=torch.long)
    return TrainBatch(input_ids=none, attention_mask=none, prompt_len=0, loss_mask=torch.zeros(0, 0))


class _InTurn:
    """A source that makes each batch when asked: nothing ahead to pause or save."""

    max_ahead = 0
    roles: RunRoles

    def after_update(self, clock: StepClock) -> None:
        if self.roles.sync_generator():
            clock.mark("sync")

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def queued(self) -> list[QueuedBatch]:
        return []

    def restore(self, batches: list[QueuedBatch], version: int) -> None:
        if batches:
            raise ValueError("this source makes every batch when asked and queues none")

    def close(self) -> None:
        pass


class OnPolicy(_InTurn):
    def __init__(self, collector: Collector, experience: Experience, prompts_per_step: int) -> None:
        self.collector, self.experience, self.roles = collector, experience, experience.roles
        self.prompts_per_step = prompts_per_step

    def next(self, clock: StepClock) -> StepBatch:
        metrics = Aggregator()
        prompts, rollouts = self.collector.collect(self.collector.draw(self.prompts_per_step), metrics, clock)
        return StepBatch(prompts, rollouts, self.experience(rollouts, metrics, clock), metrics,
                         dropped=self.collector.dropped)


class Offline(_InTurn):
    """SFT and preference methods: ``collate(prompts)`` makes the batch."""

    def __init__(self, data: RunData, collate: Callable[[Sequence[Prompt]], TrainBatch], roles: RunRoles,
                 prompts_per_step: int) -> None:
        self.data, self.collate, self.roles = data, collate, roles
        self.prompts_per_step = prompts_per_step

    def next(self, clock: StepClock) -> StepBatch:
        prompts = self.data.draw(self.prompts_per_step)
        return StepBatch(prompts, [], self.collate(prompts), Aggregator())


class AheadOfLearner:
    """Batches generated and scored up to ``max_staleness`` policy versions ahead by a
    producer thread on its own copy of the weights (``docs/async.md``)."""

    def __init__(self, collector: Collector, experience: Experience, *, max_staleness: int,
                 prompts_per_step: int, threads: int | None = None) -> None:
        self.roles = experience.roles
        if self.roles.shared_weights:
            raise ValueError("rollouts ahead of the learner need a generator with its own weights")
        self.experience = experience
        self.max_ahead = max_staleness
        self.producer = AsyncRollouts(max_staleness=max_staleness, prompts_per_step=prompts_per_step,
                                      collector=collector, version=self.roles.learner.version,
                                      threads=threads)

    def next(self, clock: StepClock) -> StepBatch:
        prompts, rollouts, produced, waited = self.producer.take(self.roles.learner.version)
        metrics = Aggregator()
        metrics.add(produced)
        clock.mark("wait")
        return StepBatch(prompts, rollouts, self.experience(rollouts, metrics, clock), metrics, learner_wait_s=waited,
                         dropped=self.producer.last_dropped)

    def after_update(self, clock: StepClock) -> None:
        learner = self.roles.learner
        self.producer.publish(learner.version, learner.export_weights())
        clock.mark("sync")

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        with self.producer.paused():  # the producer's generator, with the learner's newest weights
            self.producer.load_latest()
            yield

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.producer.paused()

    def queued(self) -> list[QueuedBatch]:
        return self.producer.queued()

    def restore(self, batches: list[QueuedBatch], version: int) -> None:
        self.producer.restore(batches, version=version)

    def close(self) -> None:
        self.producer.close()
