"""Checking config mappings against a table of options, with errors that name the bad key
or value and the valid ones."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

REQUIRED = object()
"""The default of an option that has none: leaving it out is an error."""


@dataclass(frozen=True)
class Option:
    """One config key: its default (or :data:`REQUIRED`) and the types it accepts."""

    default: Any
    types: tuple[type, ...]

    def describe(self) -> str:
        return " or ".join("null" if t is type(None) else t.__name__ for t in self.types)


def resolve_options(given: Mapping[str, Any], options: Mapping[str, Option], *,
                    where: str) -> dict[str, Any]:
    """``given`` with every option of the table filled in: unknown keys, values of the
    wrong type (a bool is not an int here) and missing required keys are errors."""
    for key in given:
        if key not in options:
            raise ValueError(f"{where}: unknown key {key!r}{_closest(key, options)}; "
                             f"valid keys: {', '.join(sorted(options))}")
    out: dict[str, Any] = {}
    for key, option in options.items():
        if key not in given:
            if option.default is REQUIRED:
                raise ValueError(f"{where}: missing key {key!r}")
            out[key] = option.default
            continue
        value = given[key]
        if not _has_type(value, option.types):
            raise ValueError(f"{where}: {key!r} must be {option.describe()}, "
                             f"got {type(value).__name__} {value!r}")
        out[key] = value
    return out


def resolve_name(name: Any, valid: Iterable[str], *, what: str) -> str:
    """``name`` if it is one of ``valid``, else an error listing them."""
    valid = sorted(valid)
    if not isinstance(name, str) or name not in valid:
        hint = _closest(name, valid) if isinstance(name, str) else ""
        raise ValueError(f"unknown {what} {name!r}{hint}; valid: {', '.join(valid)}")
    return name


def _has_type(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _closest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
