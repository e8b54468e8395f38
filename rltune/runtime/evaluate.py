"""Held-out evaluation: generate on the eval prompts and score with the run's rewards, or
(preference methods) score the held-out pairs with the learner's model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rltune.config.schema import EvalConfig, RolloutConfig
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.metrics import keys
from rltune.metrics.types import scalars
from rltune.rewards.scorer import ScoreStats
from rltune.runtime.experience import rollout_metrics
from rltune.runtime.preference import PreferenceParts
from rltune.runtime.protocols import Generator, Scorer


@dataclass(frozen=True)
class Evaluated:
    """A held-out evaluation: its metrics (``eval/...``) and, when it generated, the scored
    rollouts and the samples each reward function failed on (``failed``: name -> count)."""

    metrics: dict[str, float]
    rollouts: list[Rollout] = field(default_factory=list)
    failed: dict[str, float] = field(default_factory=dict)


class Evaluation(Protocol):
    def __call__(self) -> Evaluated:
        """The held-out evaluation of the learner's current policy."""
        ...


@dataclass(frozen=True)
class GeneratedEvaluation:
    """Generate on ``prompts`` with the run's generator and score with its rewards."""

    generator: Generator
    scorer: Scorer
    prompts: list[Prompt]
    eval: EvalConfig
    rollout: RolloutConfig

    def __call__(self) -> Evaluated:
        return evaluate(
            self.generator, self.scorer, self.prompts,
            max_new_tokens=self.eval.max_new_tokens or self.rollout.max_new_tokens,
            temperature=self.eval.temperature, batch_size=self.eval.batch_size,
            max_prompts=self.eval.max_prompts, stop=self.rollout.stop,
        )


@dataclass(frozen=True)
class PreferenceEvaluation:
    """Held-out preference metrics of the learner's newest weights, scored by the learner
    itself (``parts.evaluate``)."""

    parts: PreferenceParts

    def __call__(self) -> Evaluated:
        return Evaluated(self.parts.evaluate())


def evaluate(
    generator: Generator,
    scorer: Scorer,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    max_prompts: int | None = None,
    stop: tuple[str, ...] = (),
) -> Evaluated:
    """One completion per prompt (greedy when ``temperature == 0``); its metrics are the
    reward statistics under ``eval/`` (``eval/reward/<name>`` is each reward function's
    mean; ``eval/accuracy`` and ``eval/accuracy/<name>`` when there are verifiers)."""
    chosen = list(prompts[:max_prompts] if max_prompts is not None else prompts)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=temperature, stop=stop)
    rollouts, stats = [], []
    for start in range(0, len(chosen), batch_size):
        part = chosen[start : start + batch_size]
        done = generator.generate(part, params, group_offset=start)
        stats.append(scorer.score({p.id: p for p in part}, done))
        rollouts.extend(done)
    metrics = scalars(rollout_metrics(rollouts, group_size=1, accuracy=scorer.accuracy_names))
    failed = {name: float(fn.errors.value) for name, fn in ScoreStats.combine(stats).per_fn.items()}
    return Evaluated({keys.eval_key(k): v for k, v in metrics.items()}, rollouts, failed)
