"""The calibration file of ``rltune plan --calibrate``: JSON with a format and version,
the machine, the CPU :class:`Cluster`, the fitted :class:`Efficiency` and the probes.
Reading it checks every value, since a hand-edited file reaches the timing model's
divisions."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from rltune.plan.errors import PlanError
from rltune.plan.spec import Cluster, Efficiency

CALIBRATION_FORMAT = "rltune-plan-calibration"
CALIBRATION_VERSION = 1
"""Bumped when the file's layout or a constant's meaning changes (older files refused)."""


def save_calibration(path: Path, cluster: Cluster, eff: Efficiency, *, fitted: Sequence[str],
                     machine: dict[str, Any], probes: Sequence[dict[str, Any]] = ()) -> Path:
    """Write the calibration JSON: format, version, the machine, the CPU cluster, the
    efficiencies (with which were fitted) and the probes measured and predicted."""
    doc = {
        "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "machine": machine,
        "cluster": dataclasses.asdict(cluster), "efficiency": dataclasses.asdict(eff),
        "fitted": list(fitted), "probes": list(probes),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _record(cls: type, data: Any, path: Path, key: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, dict) or set(data) - names:
        unknown = sorted(set(data) - names) if isinstance(data, dict) else type(data).__name__
        raise PlanError(f"calibration file {path}: `{key}` is not a {cls.__name__} ({unknown}); "
                        "run `rltune plan --calibrate` again")
    for name, value in data.items():
        problem = _value_problem(name, value, get_type_hints(cls)[name])
        if problem is not None:
            raise PlanError(f"calibration file {path}: `{key}.{name}` is {value!r}: {problem}; "
                            "run `rltune plan --calibrate` again")
    try:
        return cls(**data)
    except TypeError as err:
        raise PlanError(f"calibration file {path}: `{key}`: {err}; run `rltune plan --calibrate` again") from None


def _value_problem(name: str, value: Any, hint: Any) -> str | None:
    """Why ``value`` cannot be the field ``name`` of type ``hint`` of a calibration record,
    or None: counts are integers >= 1, seconds (``*_s``) finite and >= 0, every other
    number (a rate, a size, a fraction of a peak) finite and > 0, since the timing model
    divides by it; a ``Literal`` one of its values, a ``str`` a string."""
    if get_origin(hint) is Literal:
        return None if value in get_args(hint) else f"expected one of {list(get_args(hint))}"
    if hint is str:
        return None if isinstance(value, str) else "expected a string"
    if hint is bool:
        return None if isinstance(value, bool) else "expected true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "expected an integer >= 1"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return "expected a finite number"
        if name.endswith("_s"):
            return None if value >= 0 else "expected seconds >= 0"
        return None if value > 0 else "expected a number > 0 (the planner divides by it)"
    return None


def load_calibration(path: str | Path) -> tuple[Cluster, Efficiency]:
    """The CPU :class:`Cluster` and fitted :class:`Efficiency` of a calibration file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as err:
        raise PlanError(f"calibration file {path}: cannot read it ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanError(f"calibration file {path}: not JSON ({err}); run `rltune plan --calibrate` again") from None
    if not isinstance(doc, dict) or doc.get("format") != CALIBRATION_FORMAT:
        raise PlanError(f"calibration file {path}: not an rltune plan calibration (no "
                        f"\"format\": \"{CALIBRATION_FORMAT}\")")
    if doc.get("version") != CALIBRATION_VERSION:
        raise PlanError(f"calibration file {path}: version {doc.get('version')!r}, this rltune reads "
                        f"version {CALIBRATION_VERSION}; run `rltune plan --calibrate` again")
    for key in ("cluster", "efficiency"):
        if key not in doc:
            raise PlanError(f"calibration file {path}: no `{key}`; run `rltune plan --calibrate` again")
    return _record(Cluster, doc["cluster"], path, "cluster"), _record(Efficiency, doc["efficiency"], path, "efficiency")
