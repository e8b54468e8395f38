"""The Ray runtime's learner restarts (``rltune/runtime/ray/run.py``), with the run's
parts replaced by stand-ins: every learner death is recorded in ``faults.jsonl`` of the
directory that continues the run, also one that happens while the restarted run is being
built, and the budget of restarts is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rltune.runtime.ray.run as ray_run
from rltune.config import load_config
from rltune.runtime.ray.cluster import RayRuntimeError
from rltune.runtime.ray.learner import LearnerDied


class _Roles:
    def __init__(self, *args: object) -> None:
        pass

    def close(self) -> None:
        pass


def _restarting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: list[str], restarts: int) -> Path:
    """Run ``_train_resuming`` where each build / train does what ``events`` says next:
    ``ok`` or ``dies``. Returns the run directory."""
    todo = iter(events)

    def step(*args: object, **kwargs: object) -> object:
        if next(todo) == "dies":
            raise LearnerDied("learner 0 died")
        return object()

    monkeypatch.setattr(ray_run, "RayRoles", _Roles)
    monkeypatch.setattr(ray_run, "build_run", step)
    monkeypatch.setattr(ray_run, "train", step)
    cfg = load_config(None, [f"log.dir={tmp_path}", "name=r", f"runtime.learner_restarts={restarts}",
                             "checkpoint.final=false"])
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    ray_run._train_resuming(cfg, None, None, run_dir)
    return run_dir


def _faults(run_dir: Path) -> list[int]:
    return [json.loads(line)["restarts_left"] for line in (run_dir / "faults.jsonl").read_text().splitlines()]


def test_a_death_while_the_restart_is_built_is_recorded_too(tmp_path, monkeypatch):
    # build ok, train dies; build dies; build ok, train ok
    run_dir = _restarting(tmp_path, monkeypatch, ["ok", "dies", "dies", "ok", "ok"], restarts=2)
    assert _faults(run_dir) == [1, 0]


def test_the_restarts_run_out(tmp_path, monkeypatch):
    with pytest.raises(RayRuntimeError, match="runtime.learner_restarts is used up"):
        _restarting(tmp_path, monkeypatch, ["ok", "dies", "ok", "dies"], restarts=1)
    assert _faults(tmp_path / "r") == [0]
