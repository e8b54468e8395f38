"""``runtime.mode: ray``: a run whose generators, scorers and learners are Ray actors,
driven by the one loop of ``runtime/loop.py``.

:func:`run_ray` joins or starts Ray, reserves the placement, builds the run through
:func:`rltune.runtime.local.build_run` with :class:`RayRoles`, and trains. When a learner
actor dies the whole group is lost with its optimizer state, so the run is rebuilt and
resumes from its newest checkpoint, without a person, up to ``runtime.learner_restarts``
times (recorded in ``RUN/faults.jsonl``). Dead generator and scorer actors are replaced
within the step (``rollouts.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import torch

from rltune.checkpoint.export import export_hf
from rltune.checkpoint.store import latest_checkpoint
from rltune.config import Config
from rltune.runtime.local import build_run, learner_model
from rltune.runtime.loop import Run, train
from rltune.runtime.ray.cluster import (
    Placement,
    RayRuntimeError,
    connect,
    place,
    record_fault,
)
from rltune.runtime.ray.learner import LearnerDied, RayLearnerGroup
from rltune.runtime.ray.rollouts import RayGenerator, RayScorer
from rltune.runtime.state import checkpoints_of


class RayRunState:
    """The RNG streams a checkpoint carries: the driver's own (``generators``) and each
    generator actor's sampling stream, mirrored here as ``sampling/I`` when a checkpoint
    is written and handed back to the actors when one is restored."""

    def __init__(self, generators: dict[str, torch.Generator], roles: "RayRoles") -> None:
        self._own = generators
        self._roles = roles
        self._mirrors: dict[str, torch.Generator] = {}

    @property
    def generators(self) -> dict[str, torch.Generator]:
        gen = self._roles.current_generator
        if gen is not None:
            for i, state in enumerate(gen.rng_states()):
                self._mirrors.setdefault(f"sampling/{i}", torch.Generator()).set_state(state)
        return {**self._own, **self._mirrors}

    def restored(self) -> None:
        gen = self._roles.current_generator
        if gen is not None:
            gen.set_rng_states([self._mirrors[f"sampling/{i}"].get_state() for i in range(gen.pool.size)])


class RayRoles:
    """Starts the run's actors in ``placement`` (see ``rltune.runtime.local.Roles``)."""

    def __init__(self, placement: Placement, config_dir: Path | None, run_dir: Path) -> None:
        self.placement = placement
        self.config_dir = str(config_dir) if config_dir else None
        self.faults_file = run_dir / "faults.jsonl"
        self.current_generator: RayGenerator | None = None
        self.started: list[Any] = []

    def learner(self, cfg: Config, model_dir: str) -> RayLearnerGroup:
        return self._keep(RayLearnerGroup(cfg, model_dir, self.placement))

    def generator(self, cfg: Config, model_dir: str) -> RayGenerator:
        self.current_generator = self._keep(RayGenerator(cfg, model_dir, self.config_dir, self.placement, self.faults_file))
        return self.current_generator

    def scorer(self, cfg: Config) -> RayScorer:
        return self._keep(RayScorer(cfg, self.config_dir, self.placement, self.faults_file))

    def run_state(self, generators: dict[str, torch.Generator]) -> RayRunState:
        return RayRunState(generators, self)

    def _keep(self, part: Any) -> Any:
        self.started.append(part)
        return part

    def close(self) -> None:
        """Stop every actor this object started (idempotent)."""
        parts, self.started, self.current_generator = self.started, [], None
        for part in parts:
            try:
                part.close()
            except Exception:  # noqa: BLE001 - an actor already gone needs no stopping
                pass


def run_ray(cfg: Config, *, config_dir: Path | None = None) -> Run:
    """Train ``cfg`` with its roles as Ray actors and export the final model; resume from
    the newest checkpoint when the learner dies (up to ``runtime.learner_restarts``)."""
    started = connect(cfg.runtime)
    run_dir = Path(cfg.log.dir) / cfg.name
    try:
        placement = place(cfg.runtime.placement, name=f"rltune-{cfg.name}")
        try:
            run = _train_resuming(cfg, config_dir, placement, run_dir)
        finally:
            placement.remove()
    finally:
        if started:
            ray.shutdown()
    return run


def _train_resuming(cfg: Config, config_dir: Path | None, placement: Placement, run_dir: Path) -> Run:
    restarts_left = cfg.runtime.learner_restarts
    while True:
        roles = RayRoles(placement, config_dir, run_dir)
        try:
            run = build_run(cfg, config_dir=config_dir, roles=roles)
            train(run)
            if cfg.checkpoint.final:
                _export_final(cfg, run)
            return run
        except LearnerDied as err:
            newest = latest_checkpoint(checkpoints_of(run_dir))
            if restarts_left <= 0:
                raise RayRuntimeError(f"{err}; runtime.learner_restarts is used up") from None
            restarts_left -= 1
            _record_fault(run_dir, err, newest, restarts_left)
            # a run that started fresh resumes from its own newest checkpoint, or starts over
            # in its own directory (``auto`` finding no checkpoint; ``never`` would refuse the
            # directory this attempt wrote, and ``overwrite`` would move it aside)
            cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
                update={"resume": str(newest) if newest is not None else "auto", "overwrite": False})})
        finally:
            roles.close()


def _record_fault(run_dir: Path, err: Exception, newest: Path | None, restarts_left: int) -> None:
    print(f"rltune: {err}; resuming from {newest or 'the start'} ({restarts_left} learner restarts left)", flush=True)
    record_fault(run_dir / "faults.jsonl", role="learner", event="resumed", error=str(err),
                 checkpoint=str(newest) if newest is not None else None, restarts_left=restarts_left)


def _export_final(cfg: Config, run: Run) -> None:
    """The final model as a plain HF directory, from the learner group's weights."""
    from rltune.models.load import resolve_model

    model = learner_model(cfg, resolve_model(cfg.model.path))
    model.load_state_dict(run.learner.fetch_weights())
    export_hf(model, run.tokenizer, run.run_dir / "final")
