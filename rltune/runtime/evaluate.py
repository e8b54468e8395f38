"""Held-out evaluation: generate on the eval prompts and score with the run's rewards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rltune.data.records import Prompt, SamplingParams
from rltune.metrics.types import scalars
from rltune.runtime.experience import rollout_metrics


def evaluate(
    generator: Any,
    scorer: Any,
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
    metrics = scalars(rollout_metrics(rollouts, group_size=1, accuracy=getattr(scorer, "accuracy_names", ())))
    return {f"eval/{k}": v for k, v in metrics.items()}
