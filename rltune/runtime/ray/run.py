"""``runtime.mode: ray``: a run whose generators, scorers and learners are Ray actors,
driven by the one loop of ``runtime/loop.py``.

:func:`run_ray` joins or starts Ray, reserves the placement, builds the run through
:func:`rltune.runtime.build.build_run` with :class:`~rltune.runtime.ray.roles.RayRoles`,
and trains. When a learner
actor dies the whole group is lost with its optimizer state, so the run is rebuilt and
resumes from its newest checkpoint, without a person, up to ``runtime.learner_restarts``
times (recorded in ``RUN/faults.jsonl``). Dead generator and scorer actors are replaced
within the step (``rollouts.py``).
"""

from __future__ import annotations

from pathlib import Path

import ray

from rltune.checkpoint.export import export_hf
from rltune.checkpoint.store import latest_checkpoint
from rltune.config import Config
from rltune.runtime.build import build_run
from rltune.runtime.loop import train
from rltune.runtime.parts import Run
from rltune.runtime.ray.cluster import (
    Placement,
    RayRuntimeError,
    connect,
    place,
    raised_in_actor,
    record_fault,
    refusals,
)
from rltune.runtime.ray.learner import LearnerDied
from rltune.runtime.ray.roles import RayRoles, model_roles
from rltune.runtime.roles import learner_model
from rltune.runtime.rundir import checkpoints_of


def run_ray(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Train ``cfg`` with its roles as Ray actors and export the final model; resume from
    the newest checkpoint when the learner dies (up to ``runtime.learner_restarts``)."""
    started = connect(cfg.runtime, model_roles(cfg))
    run_dir = Path(cfg.log.dir) / cfg.name
    try:
        placement = place_run(cfg, name=f"rltune-{cfg.name}")
        try:
            run = _train_resuming(cfg, config_dir, placement, run_dir)
        finally:
            placement.remove()
    finally:
        if started:
            ray.shutdown()
    return run


def place_run(cfg: Config, *, name: str) -> Placement:
    """Reserve the bundles of ``cfg``'s actors: ``runtime.placement``, and a reference and
    a critic actor when the algorithm needs them."""
    return place(cfg.runtime.placement, name=name, extra=model_roles(cfg))


def _train_resuming(cfg: Config, config_dir: Path | None, placement: Placement, run_dir: Path) -> Run:
    restarts_left = cfg.runtime.learner_restarts
    faults: list[tuple[Exception, Path | None, int]] = []  # not yet recorded
    while True:
        roles = RayRoles(placement, config_dir, run_dir)
        try:
            try:
                run = build_run(cfg, roles, config_dir=config_dir)
            finally:  # in the directory that continues the run (a fresh start moves the old one aside)
                for fault in faults:
                    _record_fault(run_dir, *fault)
                faults.clear()
            train(run)
            if cfg.checkpoint.final:
                _export_final(cfg, run)
            return run
        except (LearnerDied, ray.exceptions.RayTaskError) as raised:
            # an actor refusing its input as the run resumes may see what the killed ones
            # still held (GPU memory, a port): a death too; at the first start, the user's error
            resumed = restarts_left < cfg.runtime.learner_restarts
            if not isinstance(raised, LearnerDied) and not (resumed and isinstance(raised, refusals())):
                raise
            err = raised if isinstance(raised, LearnerDied) else raised_in_actor(raised)
            newest = latest_checkpoint(checkpoints_of(run_dir))
            if restarts_left <= 0:
                raise RayRuntimeError(f"{err}; runtime.learner_restarts is used up") from None
            restarts_left -= 1
            print(f"rltune: {err}; resuming from {newest or 'the start'} ({restarts_left} learner restarts left)",
                  flush=True)
            faults.append((err, newest, restarts_left))
            # a run that started fresh resumes from its own newest checkpoint, or starts over
            # (``auto`` finding no checkpoint moves this attempt's files aside; ``never``
            # would refuse the directory this attempt wrote)
            cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
                update={"resume": str(newest) if newest is not None else "auto", "overwrite": False})})
        finally:
            roles.close()


def _record_fault(run_dir: Path, err: Exception, newest: Path | None, restarts_left: int) -> None:
    record_fault(run_dir / "faults.jsonl", role="learner", event="resumed", error=str(err),
                 checkpoint=str(newest) if newest is not None else None, restarts_left=restarts_left)


def _export_final(cfg: Config, run: Run) -> None:
    """The final model as a plain HF directory, from the learner group's weights."""
    from rltune.models.load import resolve_model

    model_dir = resolve_model(cfg.model.path)
    model = learner_model(cfg, model_dir)
    model.load_state_dict(run.learner.fetch_weights())
    export_hf(model, run.tokenizer, run.run_dir / "final", processor_from=Path(model_dir))
