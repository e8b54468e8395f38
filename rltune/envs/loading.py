"""Turning ``env.name`` + ``env.kwargs`` into a factory of fresh environments."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from rltune.envs.base import Environment
from rltune.rewards.loading import RewardLoadError, load_callable

_ALIASES = {"builtin": "rltune.envs.builtin"}


class EnvLoadError(ValueError):
    """An ``env`` config that does not give working environments."""


def load_env_factory(
    spec: str, kwargs: Mapping[str, Any], *, base_dir: str | Path | None = None
) -> Callable[[], Environment]:
    """``() -> Environment``: calls the class or function ``spec`` names with ``kwargs``.
    One environment is made now, so that a bad spec, bad kwargs or an object without
    ``reset``/``step`` fail here, before any model is trained, with the reason."""
    try:
        factory = load_callable(
            spec, base_dir=None if base_dir is None else str(base_dir), aliases=_ALIASES,
            what="env", allow_class=True,
        )
    except RewardLoadError as exc:
        raise EnvLoadError(str(exc)) from exc
    make = partial(factory, **dict(kwargs))
    try:
        probe = make()
    except Exception as exc:  # the user's factory rejected its kwargs, or crashed
        raise EnvLoadError(f"env {spec!r} with kwargs {dict(kwargs)}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(probe, Environment):
        raise EnvLoadError(
            f"env {spec!r} made a {type(probe).__name__}, which has no reset(prompt) and "
            "step(action) methods; see rltune.envs.base.Environment"
        )
    return make
