"""The forms a reward function can take, and the one exception that is not an error.

Per sample (the common form)::

    def fn(prompt: Prompt, completion: str, **meta) -> float | None

``meta`` is the prompt's ``meta`` merged with the config's ``kwargs``. ``async def`` works
the same way: the scorer runs coroutines on one event loop, concurrently. Every call, of
any form, gets its own copies of the prompt, ``meta`` and kwargs (immutable values and
pixel tensors shared; :mod:`rltune.rewards.arguments`): changing them is harmless.

Batched (one call per scoring round: a reward model, a judge behind an API)::

    @batched
    def fn(prompts: list[Prompt], completions: list[str], **kwargs) -> Sequence[float | None | Exception]

``kwargs`` are the config's ``kwargs`` only; each row's dataset fields are in
``prompts[i].meta``. The result has one entry per completion: a number, None (no score)
or an exception instance (no score, its message kept). Raising fails the whole call: every
sample it covered gets the error. ``async def`` batched functions are awaited.

Any failure is "no score": the sample is masked out of the advantage, counted in
``reward/errors`` and shown with its message in ``samples.jsonl``; it is never a 0.
A reward may raise :class:`SampleDropped` instead (a safety filter dropping a harmful
response): the sample is masked out the same way, but counted in ``reward/dropped``, not
as an error.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_BATCHED_ATTR = "__rltune_batched__"
_VERIFIER_ATTR = "__rltune_verifier__"


def batched(fn: F) -> F:
    """Mark ``fn`` as a batched reward: ``fn(prompts, completions, **kwargs) -> list``."""
    setattr(fn, _BATCHED_ATTR, True)
    return fn


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked with :func:`batched`."""
    return bool(getattr(fn, _BATCHED_ATTR, False))


def verifier(fn: F) -> F:
    """Mark ``fn`` as a verifier: 1.0 means the answer is correct, anything less that it
    is not, so the share of samples scoring 1.0 is the step's accuracy
    (``accuracy/NAME`` in the metrics)."""
    setattr(fn, _VERIFIER_ATTR, True)
    return fn


def is_verifier(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked with :func:`verifier`."""
    return bool(getattr(fn, _VERIFIER_ATTR, False))


class SampleDropped(Exception):
    """Raised (or returned, by a batched reward) to drop a sample on purpose: it is left
    out of learning like an unscored sample and counted in ``reward/dropped``."""
