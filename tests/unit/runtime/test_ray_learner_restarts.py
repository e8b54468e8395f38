"""The Ray runtime's learner restarts (``rltune/runtime/ray/run.py``), with the run's
parts replaced by stand-ins: every learner death is recorded in ``faults.jsonl`` of the
directory that continues the run, also one that happens while the restarted run is being
built, and the budget of restarts is kept; an actor's refusal is a death once the run has
resumed, and the user's own error at its first start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

import rltune.runtime.ray.run as ray_run  # noqa: E402
from rltune.config import ConfigError, load_config  # noqa: E402
from rltune.runtime.ray.cluster import RayRuntimeError  # noqa: E402
from rltune.runtime.ray.learner import LearnerDied  # noqa: E402


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
        event = next(todo)
        if event == "dies":
            raise LearnerDied("learner 0 died")
        if event == "refuses":  # an actor's constructor refused, as Ray hands it to the driver
            cause = ConfigError("GPU 0 is out of memory")
            raise ray_exceptions.RayTaskError("LearnerActor.__init__", f"Traceback ...\nConfigError: {cause}",
                                              cause).as_instanceof_cause()
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


def test_a_refusal_as_the_run_resumes_counts_as_a_death(tmp_path, monkeypatch):
    """The resumed run's actors may see what the killed ones still held (GPU memory, a
    port): their refusal uses a restart. Build ok, train dies; the rebuild refuses; build
    ok, train ok."""
    run_dir = _restarting(tmp_path, monkeypatch, ["ok", "dies", "refuses", "ok", "ok"], restarts=2)
    assert _faults(run_dir) == [1, 0]
    errors = [json.loads(line)["error"] for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert errors == ["learner 0 died", "GPU 0 is out of memory"]


def test_a_refusal_at_the_first_start_is_the_users_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="GPU 0 is out of memory"):
        _restarting(tmp_path, monkeypatch, ["refuses"], restarts=2)
    assert not (tmp_path / "r" / "faults.jsonl").exists()
