"""Generating and scoring a step's rollouts, DAPO's refill rounds included."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rltune.algos import groups_with_spread, overlong_penalty
from rltune.algos.registry import overlong_limit
from rltune.config.schema import Config
from rltune.data.records import Prompt, Rollout, SamplingParams
from rltune.metrics import keys
from rltune.metrics.types import Aggregator
from rltune.runtime.clock import StepClock
from rltune.runtime.experience import rewards_tensor
from rltune.runtime.parts import RunData
from rltune.runtime.protocols import Generator, Scorer, Weights


class Collector:
    """The generator and scorer of an online run, fed from the run's prompt sampler.

    Whoever drives it (the loop, or the producer generating ahead of the learner) draws
    prompts with :meth:`draw`, makes a step's rollouts with :meth:`collect` and loads new
    weights into the generator with :meth:`load_weights`."""

    def __init__(self, cfg: Config, data: RunData, generator: Generator, scorer: Scorer) -> None:
        self.cfg = cfg
        self.data = data
        self.generator = generator
        self.scorer = scorer
        self.dropped: list[Rollout] = []
        """The scored rollouts the last :meth:`collect` dropped (dynamic sampling)."""
        r = cfg.rollout
        self.params = SamplingParams(
            n=cfg.algo.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
            top_p=r.top_p, top_k=r.top_k, stop=r.stop,
        )

    def draw(self, n: int) -> list[Prompt]:
        return self.data.draw(n)

    def load_weights(self, version: int, tensors: Weights | None) -> None:
        self.generator.load_weights(version, tensors)

    def collect(
        self, prompts: list[Prompt], metrics: Aggregator, clock: StepClock,
        *, draw: Callable[[int], list[Prompt]] | None = None,
    ) -> tuple[list[Prompt], list[Rollout]]:
        """Generate and score ``group_size`` samples per prompt.

        With ``algo.dynamic_sampling`` (DAPO) groups whose valid rewards are all equal carry
        no signal and are dropped; more prompts are drawn and generated, up to
        ``algo.max_refill_rounds`` extra rounds, until ``train.prompts_per_step`` groups are
        kept (the surplus of the last round is dropped too). The step then learns on the
        groups it has, which may be fewer. ``draw(n)`` draws the refill prompts (default:
        :meth:`draw`).
        """
        a = self.cfg.algo
        self.dropped = []
        rollouts = self._generate_and_score(prompts, clock, metrics, group_offset=0)
        if not a.dynamic_sampling:
            return prompts, rollouts
        draw = draw if draw is not None else self.draw
        wanted, group = len(prompts), a.group_size
        drawn, rounds = len(prompts), 0
        kept_prompts, kept = self._groups_with_signal(prompts, rollouts, group)
        while len(kept_prompts) < wanted and rounds < a.max_refill_rounds:
            rounds += 1
            more = draw(wanted - len(kept_prompts))
            new = self._generate_and_score(more, clock, metrics, group_offset=drawn)
            drawn += len(more)
            more_prompts, more_rollouts = self._groups_with_signal(more, new, group)
            kept_prompts += more_prompts
            kept += more_rollouts
        metrics.add({keys.GROUPS_KEPT_FRAC: len(kept_prompts) / drawn, keys.GROUPS_REFILL_ROUNDS: float(rounds)})
        self.dropped += kept[wanted * group:]
        return kept_prompts[:wanted], kept[: wanted * group]

    def _groups_with_signal(
        self, prompts: list[Prompt], rollouts: list[Rollout], group_size: int
    ) -> tuple[list[Prompt], list[Rollout]]:
        """The groups with a reward spread, and their rollouts; the others' rollouts are
        kept in :attr:`dropped` (their reward errors are still the step's)."""
        rewards, valid = rewards_tensor(rollouts)
        keep = groups_with_spread(rewards, group_size, valid=valid).tolist()
        self.dropped += [r for i, r in enumerate(rollouts) if not keep[i // group_size]]
        return (
            [p for p, k in zip(prompts, keep) if k],
            [r for i, r in enumerate(rollouts) if keep[i // group_size]],
        )

    def _generate_and_score(
        self, prompts: list[Prompt], clock: StepClock, metrics: Aggregator, *, group_offset: int,
    ) -> list[Rollout]:
        rollouts = self.generator.generate(prompts, self.params, group_offset=group_offset)
        clock.mark("generate")
        stats = self.scorer.score({p.id: p for p in prompts}, rollouts)
        # counts and seconds, summed over refill rounds
        metrics.add(stats.metrics())
        if self.cfg.algo.overlong_buffer:
            self._apply_overlong_penalty(rollouts)
        clock.mark("score")
        return rollouts

    def _apply_overlong_penalty(self, rollouts: list[Rollout]) -> None:
        """DAPO's soft overlong punishment added to every scored sample (``reward/overlong``),
        its length measured against :func:`~rltune.algos.registry.overlong_limit`."""
        a = self.cfg.algo
        lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)
        penalty = overlong_penalty(
            lengths, max_len=overlong_limit(self.cfg)[1], buffer=a.overlong_buffer, penalty=a.overlong_penalty
        ).tolist()
        for r, p in zip(rollouts, penalty):
            r.rewards[keys.OVERLONG_REWARD] = p
            if r.reward is not None:
                r.reward += p
