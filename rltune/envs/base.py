"""The Environment protocol: multi-turn episodes driven by the rollout side.

An episode::

    observation = env.reset(prompt)          # None: the prompt is the first observation
    loop:
        action = <the model's turn, as text>
        result = env.step(action)            # StepResult(observation, reward, done)
        if result.done: break
        <result.observation is shown to the model as a tool turn; the model goes on>

The runner (:mod:`rltune.envs.episodes`) owns the tokens: the model's turns are trained on
(loss mask 1), everything an environment adds (tool results, the chat template's turn
markers around them) is not (loss mask 0). Rewards of all steps add up to the episode's
``env`` reward; reward functions configured in ``reward`` score the final turn on top.

An environment is made fresh for each episode by a factory (a class or function called
with the config's ``env.kwargs``), so it may keep per-episode state in ``self``. ``step``
raising is a harness failure: the episode gets no score (an error, masked), it does not
stop the run; so does the factory raising. A *tool* failing (bad arguments, a division
by zero) is not a harness failure: show it to the model as the observation.

``reset`` gets a copy of the dataset's prompt (its ``meta`` copied deeply), so an
environment that changes it changes nothing for later samples or epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rltune.data.records import Prompt

MAX_OBSERVATION_CHARS = 20_000
"""The most characters an observation may have (a first observation from ``reset``, a
tool turn or an answer from ``step``): ten times :class:`~rltune.envs.tools.ToolEnv`'s
default cut of tool results, and the most that ``max_result_chars`` may be set to.
Measured before tokenising. A longer tool turn ends its episode as the token budget does
(``length``, scored); a longer first observation or answer fails its episode rather than
being cut: cutting would change what the model reads, or what reward functions score,
without the environment knowing; an environment that means to show part of a long text
cuts it itself, where it knows how."""


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` gives back. ``observation`` None with ``done`` False lets the
    model take another turn with nothing new to read. An ``observation`` with ``done``
    True is the episode's answer, given by the environment on the model's behalf (a
    retrieval agent answering with the passage its search found): reward functions score
    it instead of the model's last turn. ``done`` is a bool (None, 0 and 1 are read as
    one; anything else fails the episode, as a reward of the wrong type does); see
    :data:`MAX_OBSERVATION_CHARS` for the length of an observation."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, prompt: Prompt) -> str | None:
        """Start an episode on ``prompt``; return the first observation to show instead of
        the prompt's own text (rendered as the user's turn), or None to keep the prompt."""
        ...

    def step(self, action: str) -> StepResult:
        """The model's turn ``action`` (its text, tool call included)."""
        ...
