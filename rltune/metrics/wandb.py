"""Weights & Biases sink: metrics, histograms and the resolved config of a run, offline by
default (no account, no network); ``wandb sync RUN/wandb/offline-run-*`` uploads later.

This is the only module that imports ``wandb``; it does so when a sink is created."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rltune.metrics.sinks import check_resume_step, finite_histograms, finite_scalars, plain_config

RUN_ID_FILE = "wandb-run-id"
"""In the run directory: the W&B run id, so that a resumed run continues the same W&B run."""

MODES = ("offline", "online", "disabled")


class WandbSink:
    """Logs to a W&B run whose files live in ``run_dir/wandb/``.

    The W&B run id is kept in ``run_dir/wandb-run-id``. A fresh run gets a new id; with
    ``resume_after_step`` set, the stored id is reused (``resume="allow"``), so the
    resumed training continues the same W&B run (when no id is stored, because the run
    was started without W&B, a new one is made and stored). W&B keeps a run's history in
    step order: steps after the checkpoint that the interrupted run had already sent to
    the server are kept there and the repeated ones are ignored by W&B.

    Settings: no console capture, no git, code, requirements, machine-info or
    system-metrics capture (slow, and not this sink's business), nothing printed
    (``silent``), and each sink its own run (``reinit="create_new"``), never the global
    ``wandb.run``. In offline mode ``WANDB_ERROR_REPORTING`` defaults to ``false`` so the
    W&B service sends no error reports either (an explicit setting is kept).

    Non-finite scalars and histogram values are skipped."""

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str,
        mode: str = "offline",
        entity: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        resume_after_step: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"WandbSink: mode must be one of {list(MODES)}, got {mode!r}")
        if not project:
            raise ValueError("WandbSink: project must be a non-empty name")
        check_resume_step(resume_after_step, "WandbSink")
        self._wandb = import_wandb()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if mode == "offline":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        stored = read_run_id(self.run_dir) if resume_after_step is not None else None
        self._run: Any = self._wandb.init(
            dir=str(self.run_dir),
            project=project,
            entity=entity,
            name=name,
            tags=list(tags),
            id=stored,
            resume="allow",
            settings=_settings(self._wandb, mode),
        )
        self.run_id: str = self._run.id
        (self.run_dir / RUN_ID_FILE).write_text(self.run_id + "\n", encoding="utf-8")
        self._closed = False

    def log(
        self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        """One history row at ``step``: the finite scalars, and each non-empty histogram
        as a ``wandb.Histogram`` of its finite values. Two calls at one step (training,
        then evaluation) fill the same row."""
        row: dict[str, Any] = dict(finite_scalars(scalars))
        for key, values in finite_histograms(histograms).items():
            row[key] = self._wandb.Histogram(values)
        if row:
            self._run.log(row, step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved config as the run's config (nested keys as W&B shows them);
        values may change on a resume."""
        self._run.config.update(plain_config(config), allow_val_change=True)

    def close(self) -> None:
        """Finish the W&B run (writes the last row and the summary)."""
        if not self._closed:
            self._closed = True
            self._run.finish()


def read_run_id(run_dir: Path) -> str | None:
    """The W&B run id stored in ``run_dir/wandb-run-id``, or None when there is none."""
    path = Path(run_dir) / RUN_ID_FILE
    if not path.exists():
        return None
    run_id = path.read_text(encoding="utf-8").strip()
    if not run_id:
        raise ValueError(f"{path}: empty; it should hold the W&B run id (delete the file to start a new W&B run)")
    return run_id


def _settings(wandb: Any, mode: str) -> Any:
    return wandb.Settings(
        mode=mode,
        console="off",
        silent=True,
        disable_git=True,
        disable_code=True,
        save_code=False,
        disable_job_creation=True,
        x_disable_stats=True,
        x_disable_machine_info=True,
        x_disable_meta=True,
        x_save_requirements=False,
        reinit="create_new",
    )


def import_wandb() -> Any:
    """The ``wandb`` package; a missing one is an ``ImportError`` that says how to install it."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            f"WandbSink needs the wandb package ({exc}); install it with pip install 'rltune[wandb]'"
        ) from exc
    return wandb
