"""Held-out evaluation: generate on the eval prompts and score with the run's rewards, or
(preference methods) score the held-out pairs with the learner's model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rltune.config.schema import EvalConfig, RolloutConfig
from rltune.data.records import Prompt, SamplingParams
from rltune.metrics import keys
from rltune.metrics.types import scalars
from rltune.runtime.experience import rollout_metrics
from rltune.runtime.preference import PreferenceParts
from rltune.runtime.protocols import Generator, Learner, Scorer


class Evaluation(Protocol):
    def __call__(self) -> dict[str, float]:
        """The held-out metrics (``eval/...``) of the learner's current policy."""
        ...


@dataclass(frozen=True)
class GeneratedEvaluation:
    """Generate on ``prompts`` with the run's generator and score with its rewards."""

    generator: Generator
    scorer: Scorer
    prompts: list[Prompt]
    eval: EvalConfig
    rollout: RolloutConfig

    def __call__(self) -> dict[str, float]:
        return evaluate(
            self.generator, self.scorer, self.prompts,
            max_new_tokens=self.eval.max_new_tokens or self.rollout.max_new_tokens,
            temperature=self.eval.temperature, batch_size=self.eval.batch_size,
            max_prompts=self.eval.max_prompts, stop=self.rollout.stop,
        )


@dataclass(frozen=True)
class PreferenceEvaluation:
    """Held-out preference metrics of the learner's model: ``parts.model`` (the learner's
    own module in this process, else the driver's copy) with the learner's newest weights."""

    parts: PreferenceParts
    learner: Learner

    def __call__(self) -> dict[str, float]:
        if not self.parts.eval_prompts:
            return {}
        self.learner.copy_weights_to(self.parts.model)
        return self.parts.evaluate(self.parts.model)


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
) -> dict[str, float]:
    """One completion per prompt (greedy when ``temperature == 0``); returns the reward
    statistics under ``eval/`` (``eval/reward/<name>`` is each reward function's mean;
    ``eval/accuracy`` and ``eval/accuracy/<name>`` when there are verifiers)."""
    chosen = list(prompts[:max_prompts] if max_prompts is not None else prompts)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=temperature, stop=stop)
    rollouts = []
    for start in range(0, len(chosen), batch_size):
        part = chosen[start : start + batch_size]
        done = generator.generate(part, params, group_offset=start)
        scorer.score({p.id: p for p in part}, done)
        rollouts.extend(done)
    metrics = scalars(rollout_metrics(rollouts, group_size=1, accuracy=scorer.accuracy_names))
    return {keys.eval_key(k): v for k, v in metrics.items()}
