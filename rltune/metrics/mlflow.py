"""MLflow sink: a run's metrics (one ``log_batch`` per step) and its flattened config as
params, through ``MlflowClient`` (never MLflow's global "active run").

By default everything goes to ``RUN/mlflow.db``, a local SQLite store, which needs no
server: ``mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db`` shows it.

This is the only module that imports ``mlflow``; it does so when a sink is created.
Because importing mlflow starts its usage telemetry, ``MLFLOW_DISABLE_TELEMETRY``
defaults to ``true`` first (an explicit setting is kept): a training run makes no
network calls of its own accord."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rltune.metrics.sinks import check_resume_step, finite_scalars, plain_config

RUN_FILE = "mlflow-run.json"
"""In the run directory: the MLflow run id, experiment id and tracking URI, so that a
resumed run continues the same MLflow run."""

MAX_KEY_LENGTH = 250
"""MLflow's limit on metric, param and tag names."""
MAX_PARAM_VALUE_LENGTH = 6000
"""MLflow's limit on a param value; longer values are cut to it."""
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100

RESUMED_TAG_PREFIX = "resumed."
"""A param whose value changed on a resume (MLflow params cannot change) is stored as the
tag ``resumed.<param>`` with the new value."""

_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")


class MlflowSink:
    """Logs to one MLflow run.

    ``tracking_uri`` defaults to ``sqlite:///<run_dir>/mlflow.db`` (artifacts, if any, in
    ``run_dir/mlartifacts``). A ``file:`` URI (or a plain directory path) selects MLflow's
    file store, which MLflow 3 refuses unless ``MLFLOW_ALLOW_FILE_STORE=true``; this sink
    sets that variable (unless already set) in that case only.

    The run is found again through ``run_dir/mlflow-run.json``: a fresh run creates a new
    MLflow run and writes the file; with ``resume_after_step`` set, the stored run is
    reopened (status back to RUNNING) and continues (no file, because the run started
    without MLflow: a new MLflow run). MLflow cannot delete logged values, so the steps
    that the interrupted run logged after the checkpoint stay in the history next to
    their repeats, which have later timestamps.

    Metric and param names are made acceptable to MLflow by :func:`mlflow_key`.
    Histograms are skipped: MLflow has no histogram type. Non-finite scalars are skipped.
    MLflow's own INFO logging (database creation and migration) is silenced while the
    sink opens its store."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tracking_uri: str | None = None,
        experiment: str = "rltune",
        run_name: str | None = None,
        resume_after_step: int | None = None,
    ) -> None:
        check_resume_step(resume_after_step, "MlflowSink")
        if not experiment:
            raise ValueError("MlflowSink: experiment must be a non-empty name")
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.run_dir)
        if is_file_store(self.tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._mlflow = import_mlflow()
        self._keys: dict[str, str] = {}
        self._closed = False
        stored = read_run_file(self.run_dir) if resume_after_step is not None else None
        if stored is not None and stored["tracking_uri"] != self.tracking_uri:
            raise ValueError(f"{self.run_dir / RUN_FILE}: the MLflow run was logged to {stored['tracking_uri']}, "
                             f"not to {self.tracking_uri}; resume with that tracking URI "
                             "or delete the file to start a new MLflow run")
        with _quiet_mlflow_logging():
            self._client: Any = self._mlflow.tracking.MlflowClient(tracking_uri=self.tracking_uri)
            if stored is None:
                experiment_id = self._experiment_id(experiment, default_store=tracking_uri is None)
                run = self._client.create_run(experiment_id, run_name=run_name)
                self.run_id: str = run.info.run_id
                write_run_file(self.run_dir, self.run_id, experiment_id, self.tracking_uri)
            else:
                self.run_id = self._reopen(stored)

    # ------------------------------------------------------------------ the Sink methods

    def log(
        self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, Sequence[float]] | None = None
    ) -> None:
        """The finite scalars at ``step`` in one ``log_batch`` (more only past MLflow's
        1000 metrics per batch); ``histograms`` are ignored."""
        del histograms  # MLflow has no histogram type
        timestamp = int(time.time() * 1000)
        metrics = [
            self._mlflow.entities.Metric(self._key(name), value, timestamp, step)
            for name, value in finite_scalars(scalars).items()
        ]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The config flattened to params (``algo.name``, ``reward.0.fn``, ...; see
        :func:`flatten_config`). Params already stored with the same value are not
        logged again; a changed value (a resume with a different config) goes to the tag
        ``resumed.<param>``, since MLflow params cannot change."""
        existing = self._client.get_run(self.run_id).data.params
        params, changed = [], {}
        for key, value in flatten_config(config).items():
            key = mlflow_key(key)
            if key not in existing:
                params.append(self._mlflow.entities.Param(key, value))
            elif existing[key] != value:
                changed[mlflow_key(RESUMED_TAG_PREFIX + key)] = value
        for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
        tags = [self._mlflow.entities.RunTag(k, v) for k, v in changed.items()]
        for start in range(0, len(tags), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=tags[start : start + MAX_PARAMS_PER_BATCH])

    def close(self) -> None:
        """Mark the MLflow run FINISHED."""
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id, status="FINISHED")

    # ------------------------------------------------------------------ helpers

    def _key(self, name: str) -> str:
        key = mlflow_key(name)
        first = self._keys.setdefault(key, name)
        if first != name:
            raise ValueError(f"MlflowSink: metrics {first!r} and {name!r} both become {key!r} in MLflow; "
                             "rename one of them")
        return key

    def _experiment_id(self, name: str, *, default_store: bool) -> str:
        found = self._client.get_experiment_by_name(name)
        if found is None:
            location = (self.run_dir / "mlartifacts").as_uri() if default_store else None
            return self._client.create_experiment(name, artifact_location=location)
        if found.lifecycle_stage != "active":
            raise ValueError(f"MlflowSink: experiment {name!r} in {self.tracking_uri} is deleted; "
                             "restore it or choose another experiment name")
        return found.experiment_id

    def _reopen(self, stored: Mapping[str, str]) -> str:
        where = self.run_dir / RUN_FILE
        try:
            run = self._client.get_run(stored["run_id"])
        except self._mlflow.exceptions.MlflowException as exc:
            raise ValueError(f"{where}: MLflow run {stored['run_id']} is not in {self.tracking_uri} "
                             f"({exc.message}); delete the file to start a new MLflow run") from exc
        if run.info.lifecycle_stage != "active":
            raise ValueError(f"{where}: MLflow run {stored['run_id']} is deleted; restore it "
                             "or delete the file to start a new MLflow run")
        self._client.update_run(stored["run_id"], status="RUNNING")
        return stored["run_id"]


def default_tracking_uri(run_dir: Path) -> str:
    """``sqlite:///<absolute run_dir>/mlflow.db``."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def is_file_store(tracking_uri: str) -> bool:
    """True for a ``file:`` URI or a plain path: MLflow's file store."""
    return urlparse(tracking_uri).scheme in ("", "file")


def mlflow_key(name: str) -> str:
    """``name`` as an MLflow metric/param/tag name.

    MLflow accepts ASCII letters, digits, ``_ - . /`` and space on every platform (``:``
    not on Windows), and no name that a path normalisation would change. So: the name is
    cut to 250 characters; every other character (``:`` included) becomes ``_``; empty
    ``/``-separated parts are dropped (``a//b`` -> ``a/b``, ``/a/`` -> ``a``); a part ``.``
    becomes ``_`` and ``..`` becomes ``__``; an empty name becomes ``_``. The usual names
    (``reward/mean``, ``time/generate``, ``eval/reward/acc``) stay as they are."""
    parts = _BAD_CHARS.sub("_", name[:MAX_KEY_LENGTH]).split("/")
    kept = [{".": "_", "..": "__"}.get(part, part) for part in parts if part]
    return "/".join(kept) or "_"


def flatten_config(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"algo": {"name": "grpo"}, "reward": [{"fn": "f"}], "train": {"betas": [0.9, 0.99]}}``
    -> ``{"algo.name": "grpo", "reward.0.fn": "f", "train.betas": "[0.9, 0.99]"}``.

    Mappings nest with ``.``; a list that holds a mapping is numbered; any other list, and
    an empty mapping, is one value. Strings are kept as they are, everything else is
    written as JSON (``null``, ``true``, ``0.001``). Values longer than MLflow's 6000
    characters are cut to it."""
    out: dict[str, str] = {}
    _flatten(plain_config(config), "", out)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}{key}.", out)
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}{index}.", out)
    else:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        out[prefix[:-1]] = text[:MAX_PARAM_VALUE_LENGTH]


def read_run_file(run_dir: Path) -> dict[str, str] | None:
    """The stored ``{"run_id", "experiment_id", "tracking_uri"}``, or None when there is
    no ``run_dir/mlflow-run.json``."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it to start a new MLflow run") from exc
    keys = ("run_id", "experiment_id", "tracking_uri")
    if not isinstance(data, dict) or any(not isinstance(data.get(k), str) for k in keys):
        raise ValueError(f"{path}: expected an object with the strings {list(keys)}; "
                         "delete it to start a new MLflow run")
    return {k: data[k] for k in keys}


def write_run_file(run_dir: Path, run_id: str, experiment_id: str, tracking_uri: str) -> None:
    record = {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": tracking_uri}
    (Path(run_dir) / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


@contextmanager
def _quiet_mlflow_logging() -> Iterator[None]:
    """MLflow's and alembic's loggers at WARNING for the duration, then as they were."""
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_mlflow() -> Any:
    """The ``mlflow`` package, imported with its telemetry off unless
    ``MLFLOW_DISABLE_TELEMETRY`` says otherwise; a missing package is an ``ImportError``
    that says how to install it."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        import mlflow
        import mlflow.entities
        import mlflow.exceptions
        import mlflow.tracking
    except ImportError as exc:
        raise ImportError(
            f"MlflowSink needs the mlflow package ({exc}); install it with pip install 'rltune[mlflow]'"
        ) from exc
    return mlflow
