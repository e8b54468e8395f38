"""Reward errors on the console: each new kind once, and steps on which no sample scored.

The scorer keeps a failing reward as data (``Rollout.reward_error``, ``reward/errors``), so
one bad reward function does not stop a run. That also lets a function that fails on
*every* sample train for hours on nothing: each step's batch is empty and the console
shows ``reward -``. :class:`RewardErrorWatch` reads the rollouts of each step (of any
runtime: local and Ray scorers fill the same fields) and

- prints the first message of each kind of error once (a kind is the reward function
  and what went wrong: the exception type, ``returned str``, ``timed out``, ...);
- warns on a step where no sample got a reward and some failed;
- after ``train.max_reward_error_steps`` such steps in a row raises
  :class:`RewardErrorLimit` (0 never stops), naming the function and its first message;
- warns on a step whose batch was empty for another reason (:meth:`~RewardErrorWatch.learned_nothing`);
- prints the first message of each kind of a held-out evaluation's errors once too
  (:meth:`~RewardErrorWatch.observe_eval`); an evaluation never stops the run.

An episode whose environment failed (``reset``/``step`` raised or returned a wrong value:
``Rollout.env_error``) gets no reward either and is counted the same way; the lines name
the environment instead of the reward function for it, and both where both failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rich.markup import escape

from rltune.data.records import Rollout


class RewardErrorLimit(ValueError):
    """Every sample's reward failed on ``train.max_reward_error_steps`` steps in a row."""


_ENV, _REWARD = "environment", "reward"
_SUBJECT = {frozenset({_REWARD}): "the reward", frozenset({_ENV}): "the environment",
            frozenset({_ENV, _REWARD}): "the environment or the reward"}
_FIX = {frozenset({_REWARD}): "Fix the reward function", frozenset({_ENV}): "Fix the environment",
        frozenset({_ENV, _REWARD}): "Fix the environment and the reward function"}
"""What failed (the sources of a streak's errors) -> the words for it."""


_MAX_PRINTED = 300
"""Characters of an error message printed (samples.jsonl keeps it whole, up to the
scorer's own bound)."""


def _printed(message: str, *, logged: bool = True) -> str:
    """``message`` as the console shows it: its first :data:`_MAX_PRINTED` characters.
    ``logged``: samples.jsonl has the whole message (a held-out sample's is not logged)."""
    if len(message) <= _MAX_PRINTED:
        return message
    where = "the whole message is in samples.jsonl" if logged else f"cut at {_MAX_PRINTED} characters"
    return f"{message[:_MAX_PRINTED]}... ({where})"


def _source(rollout: Rollout) -> str:
    """Where a sample's error came from: its environment (which is then the error shown
    first) or a reward function."""
    return _ENV if rollout.env_error is not None else _REWARD


def error_kind(message: str) -> str:
    """The kind of a scorer's error message: ``NAME: TYPE`` for an exception
    (``NAME: ValueError: ...``; the message after the type varies by sample),
    ``NAME: returned TYPE`` for a value that is not a finite number, ``NAME: timed out``;
    a message without a variable part is its own kind."""
    name, sep, rest = message.partition(": ")
    if not sep:
        return message
    if rest.startswith("returned "):
        return f"{name}: returned {rest.split()[1]}"
    if rest.startswith("timed out"):
        return f"{name}: timed out"
    head, sep, _ = rest.partition(": ")
    if sep:  # an exception's type name (``env: step raised TYPE`` for an episode's)
        return f"{name}: {head}"
    return message


class RewardErrorWatch:
    """Follows the reward errors of a run's steps; ``say`` prints a console line."""

    def __init__(self, max_failed_steps: int, say: Callable[[str], None]) -> None:
        self.max_failed_steps = max_failed_steps
        self._say = say
        self._seen: set[str] = set()
        self._eval_seen: set[str] = set()
        self._failed_steps: list[int] = []
        self._first_message: str | None = None
        self._sources: set[str] = set()

    def observe(self, step: int, rollouts: Sequence[Rollout]) -> None:
        """Print what is new in ``rollouts`` (step ``step``); count a step on which no
        sample scored and at least one failed (deliberately dropped samples are no error)."""
        failed = _failed(rollouts)
        errors = [r.reward_error for r in failed]
        self._first_of_each_kind(step, failed, self._seen)
        if not errors or any(r.reward is not None for r in rollouts):
            self._failed_steps.clear()
            self._first_message = None
            self._sources.clear()
            return
        if not self._failed_steps:
            self._first_message = errors[0]
        self._failed_steps.append(step)
        self._sources |= {_source(r) for r in failed}
        subject = _SUBJECT[frozenset(_source(r) for r in failed)]
        limit = (
            f"{len(self._failed_steps)} of {self.max_failed_steps} in a row before the run stops"
            if self.max_failed_steps else "train.max_reward_error_steps=0: the run goes on"
        )
        self._say(escape(
            f"warning: step {step}: {subject} failed on all {len(errors)} samples, so the step "
            f"learned nothing ({limit})"
        ))

    def observe_eval(self, step: int, rollouts: Sequence[Rollout]) -> None:
        """Print the first message of each kind of error among the rollouts of a held-out
        evaluation at step ``step`` (kinds apart from training's: held-out rows may lack
        what training rows have). An evaluation's errors never stop the run."""
        self._first_of_each_kind(step, _failed(rollouts), self._eval_seen, held_out=True)

    def learned_nothing(self, step: int, reason: str) -> None:
        """Warn that step ``step`` learned nothing because of ``reason`` (its batch was
        empty), unless :meth:`observe` has warned about the step (no sample scored).

        Such a step does not count towards ``max_failed_steps`` unless :meth:`observe`
        counted it: DAPO's dynamic sampling keeps no group when every group's rewards are
        equal (a task solved, or none solvable), which is no error, and steps whose every
        episode failed are counted by :meth:`observe` already. The warning on each step
        and ``learn/empty_batch`` show it."""
        if self._failed_steps and self._failed_steps[-1] == step:
            return
        self._say(escape(f"warning: step {step}: {reason}, so the step learned nothing"))

    def _first_of_each_kind(self, step: int, failed: Sequence[Rollout], seen: set[str], *,
                            held_out: bool = False) -> None:
        """Say the first message of each kind of error in ``failed`` not in ``seen`` (and
        add it there); ``held_out``: of an evaluation's samples."""
        for r in failed:
            message = r.reward_error or ""
            kind = error_kind(message)
            if kind not in seen:
                seen.add(kind)
                self._say(escape(f"{'eval ' if held_out else ''}{_source(r)} error at step {step} "
                                 f"(first of its kind, not repeated): {_printed(message, logged=not held_out)}"))

    def check(self) -> None:
        """Raise :class:`RewardErrorLimit` once ``max_failed_steps`` steps in a row failed."""
        if not self.max_failed_steps or len(self._failed_steps) < self.max_failed_steps:
            return
        first, last = self._failed_steps[0], self._failed_steps[-1]
        sources = frozenset(self._sources)
        raise RewardErrorLimit(
            f"{_SUBJECT[sources]} failed on every sample of {len(self._failed_steps)} steps in a row "
            f"(steps {first}-{last}), so the run stopped: {_printed(self._first_message or '')}. {_FIX[sources]} "
            f"(samples.jsonl has each sample's error), or raise "
            f"`train.max_reward_error_steps` (0 never stops)"
        )


def _failed(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """The samples whose reward failed (deliberately dropped samples are no error)."""
    return [r for r in rollouts if r.reward_error is not None and not r.dropped]


def eval_failures(failed: Mapping[str, float], rollouts: Sequence[Rollout]) -> str:
    """What failed in a held-out evaluation, for its console line: the environment and
    each reward function (``failed``: name -> samples it failed on) that failed on some
    sample, with their counts; empty when nothing did."""
    env = sum(r.env_error is not None for r in rollouts)
    parts = [f"the environment failed on {env}"] if env else []
    parts += [f"reward {name} failed on {n:.0f}" for name, n in failed.items() if n]
    return ", ".join(parts)
