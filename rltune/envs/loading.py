"""Turning ``env.name`` + ``env.kwargs`` into a factory of fresh environments."""

from __future__ import annotations

import inspect
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
    ``reset``/``step`` fail here, before any model is trained, with the reason.

    ``base_dir`` (the config file's directory) is where a relative file spec is looked up
    first; a factory with a ``base_dir`` parameter (``builtin:tools``) also gets it, to
    resolve the relative paths of its kwargs, unless ``kwargs`` set it."""
    try:
        factory = load_callable(
            spec, base_dir=None if base_dir is None else str(base_dir), aliases=_ALIASES,
            what="env", allow_class=True,
        )
    except RewardLoadError as exc:
        raise EnvLoadError(str(exc)) from exc
    given = dict(kwargs)
    make = partial(factory, **given, **_base_dir_kwarg(factory, given, base_dir))
    try:
        probe = make()
    except Exception as exc:  # the user's factory rejected its kwargs, or crashed
        raise EnvLoadError(f"env spec {spec!r} with kwargs {given}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(probe, Environment):
        raise EnvLoadError(
            f"env spec {spec!r} made {_article(type(probe).__name__)} {type(probe).__name__}, "
            "which has no reset(prompt) and step(action) methods; see rltune.envs.base.Environment"
        )
    return make


def _article(noun: str) -> str:
    """``a`` or ``an`` before ``noun`` (by its first letter: ``an object``, ``a dict``)."""
    return "an" if noun[:1].lower() in ("a", "e", "i", "o", "u") else "a"


def _base_dir_kwarg(factory: Callable[..., Any], kwargs: Mapping[str, Any],
                    base_dir: str | Path | None) -> dict[str, str]:
    """``{"base_dir": DIR}`` for a factory that takes a ``base_dir`` keyword the config's
    kwargs leave out; else nothing."""
    if base_dir is None or "base_dir" in kwargs:
        return {}
    try:
        param = inspect.signature(factory).parameters.get("base_dir")
    except (TypeError, ValueError):  # a callable Python cannot inspect
        return {}
    if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
        return {}
    return {"base_dir": str(base_dir)}
