"""A run is typed parts: the parts are frozen and no field is ``Any``; the loop, the
checkpoint code and the evaluation call protocol methods instead of probing with
``getattr``; every runtime's roles implement every method of the ``Roles`` protocol."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import rltune.runtime as runtime_pkg
from rltune.runtime.local import LocalRoles
from rltune.runtime.parts import Progress, Run, RunData, RunRoles, RunSpec
from rltune.runtime.roles import Roles

RUNTIME = Path(runtime_pkg.__file__).parent


@pytest.mark.parametrize("part", [RunSpec, RunData, RunRoles, Run])
def test_the_parts_of_a_run_are_frozen_and_typed(part) -> None:
    assert part.__dataclass_params__.frozen, part
    for f in dataclasses.fields(part):
        assert "Any" not in str(f.type), (part.__name__, f.name, f.type)


def test_progress_is_the_one_mutable_part() -> None:
    assert not Progress.__dataclass_params__.frozen
    assert {f.name for f in dataclasses.fields(Progress)} == {"streams", "minibatch_rng", "step", "history"}


@pytest.mark.parametrize("module", ["loop.py", "state.py", "evaluate.py", "sources.py", "build.py"])
def test_no_getattr_probing(module: str) -> None:
    tree = ast.parse((RUNTIME / module).read_text())
    probes = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr")]
    assert probes == [], f"{module}: getattr/hasattr at lines {probes}"


def _methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_local_roles_implement_the_roles_protocol() -> None:
    assert _methods(Roles) <= _methods(LocalRoles)


def test_ray_roles_implement_the_roles_protocol() -> None:
    pytest.importorskip("ray")
    from rltune.runtime.ray.roles import RayRoles

    assert _methods(Roles) <= _methods(RayRoles)
