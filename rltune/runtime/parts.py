"""What a run is made of: a few typed parts, built once by
:func:`rltune.runtime.build.build_run` and not changed after, and one mutable
:class:`Progress` (the step, the history, the RNG streams) that the loop advances and a
checkpoint saves and restores.

- :class:`RunSpec`: the resolved config, the algorithm and the run directory;
- :class:`RunData`: the prompts, the prompt sampler, the tokenizer and its pad id;
- :class:`RunRoles`: the generator, scorer, learner, reference, critic and KL controller
  (``rltune.runtime.protocols``), wherever they run;
- the :class:`~rltune.runtime.sources.BatchSource` that gives each step its batch, and the
  held-out :class:`~rltune.runtime.evaluate.Evaluation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rltune.algos import Algorithm
from rltune.config.schema import Config
from rltune.data.records import Prompt
from rltune.data.sampler import PromptSampler
from rltune.runtime.kl import KLCoefficient
from rltune.runtime.protocols import Critic, Generator, Learner, Reference, Scorer, Streams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rltune.runtime.evaluate import Evaluation
    from rltune.runtime.sources import BatchSource


@dataclass(frozen=True)
class RunSpec:
    """The run as configured. ``notes``: lines for the console when training starts (an
    old run moved aside, ...)."""

    cfg: Config
    algorithm: Algorithm
    run_dir: Path
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunData:
    """The run's prompts. ``eval_prompts`` is None when nothing judges them;
    ``warnings``: bad rows skipped under ``data.on_bad_row: skip``, one line per source.
    The sampler's position is part of a checkpoint."""

    train_prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    sampler: PromptSampler
    tokenizer: "PreTrainedTokenizerBase"
    pad_id: int
    warnings: tuple[str, ...] = ()

    def draw(self, n: int) -> list[Prompt]:
        """The sampler's next ``n`` training prompts."""
        return [self.train_prompts[i] for i in self.sampler.next_batch(n)]


@dataclass(frozen=True)
class RunRoles:
    """The run's roles. ``generator`` is None for runs that never generate (preference
    methods, SFT without held-out rewards), ``scorer`` None without rewards; ``reference``
    (the KL term), ``critic`` (PPO) and ``kl`` (``algo.kl_in_reward``) only when the
    algorithm needs them. ``shared_weights``: the generator runs on the learner's own
    module, so a new policy needs no copy."""

    learner: Learner
    generator: Generator | None = None
    scorer: Scorer | None = None
    reference: Reference | None = None
    critic: Critic | None = None
    kl: KLCoefficient | None = None
    shared_weights: bool = False

    def sync_generator(self) -> bool:
        """Load the learner's current policy into the generator; False without one."""
        if self.generator is None:
            return False
        weights = None if self.shared_weights else self.learner.export_weights()
        self.generator.load_weights(self.learner.version, weights)
        return True

    def reporting(self) -> list[Generator | Scorer | Learner]:
        """The roles whose ``step_metrics`` a step logs."""
        return [part for part in (self.generator, self.scorer, self.learner) if part is not None]


@dataclass
class Progress:
    """What changes as the run trains, besides the roles' own state: the step reached,
    the metrics of the steps run in this process, and the RNG streams a checkpoint
    carries (``minibatch_rng`` shuffles mini-batches and is one of ``streams``)."""

    streams: Streams
    minibatch_rng: torch.Generator
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """One training run: its parts and its progress (``runtime/loop.py`` trains it)."""

    spec: RunSpec
    data: RunData
    roles: RunRoles
    source: "BatchSource"
    evaluation: "Evaluation | None"
    """Held-out evaluation; None when the run has nothing to judge held-out."""
    progress: Progress

    # the parts most often read, by their short names
    @property
    def cfg(self) -> Config:
        return self.spec.cfg

    @property
    def run_dir(self) -> Path:
        return self.spec.run_dir

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def history(self) -> list[dict[str, float]]:
        return self.progress.history

    @property
    def learner(self) -> Learner:
        return self.roles.learner

    @property
    def generator(self) -> Generator | None:
        return self.roles.generator

    @property
    def scorer(self) -> Scorer | None:
        return self.roles.scorer

    @property
    def train_prompts(self) -> list[Prompt]:
        return self.data.train_prompts

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase":
        return self.data.tokenizer
