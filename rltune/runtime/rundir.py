"""The run directory (``log.dir/NAME``) before a run writes anything to it.

A new run never lands in an old run's directory, and a resumed run continues the run it
claims to:

- ``checkpoint.resume: never`` needs an absent or empty directory. With
  ``checkpoint.overwrite: true`` an existing one is first moved aside, whole, to
  ``NAME.old-N`` (the first free N); nothing is deleted and the two runs never mix.
- A resume (``auto``, or a checkpoint path) compares the config with the run's saved
  ``config.yaml``, and with the config the checkpoint to resume recorded when it was
  saved (``meta["config"]``), and refuses every difference outside :data:`FREE_KEYS`,
  naming each key with its old and new value. A checkpoint path into a directory that holds another run
  is refused too (its files would mix with the old run's).

What may change on a resume (:data:`~rltune.checkpoint.meaning.FREE_KEYS`) is what does
not change what the run learns or how its figures are measured; the rules are in
:mod:`rltune.checkpoint.meaning`, which ``rltune export`` applies too. The step the
checkpoint holds is checked here as well, before anything is written: a checkpoint past
``train.steps`` is refused (raise ``train.steps`` to continue it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rltune.checkpoint.meaning import (  # noqa: F401  (FREE_KEYS, BOUND_KEYS, differences: read from here too)
    BOUND_KEYS,
    FREE_KEYS,
    check_recorded_meaning,
    check_same_meaning,
    differences,
)
from rltune.checkpoint.store import META_FILE, CheckpointError, checkpoint_step, latest_checkpoint
from rltune.config import Config, ConfigError, load_config
from rltune.runtime.resumable import check_within

RUN_CONFIG = "config.yaml"

def prepare_run_dir(cfg: Config, run_dir: Path) -> str | None:
    """Check ``run_dir`` against ``cfg.checkpoint`` before the run writes to it; move an
    old run aside when ``checkpoint.overwrite`` asks for it.

    Returns:
        A line for the console when something was moved aside, else None.

    Raises:
        ConfigError: a new run into a directory that holds a run, a resume whose config
            differs in meaning from the run's, or a checkpoint of another run resumed into
            a directory that holds a run.
    """
    resume = cfg.checkpoint.resume
    _check_is_directory(run_dir)
    if resume == "never":
        return _fresh(cfg, run_dir)
    if resume == "auto":
        saved = run_dir / RUN_CONFIG
        checkpoint = latest_checkpoint(checkpoints_of(run_dir)) if run_dir.is_dir() else None
    else:
        checkpoint = Path(resume)
        if not checkpoint.is_dir():
            raise ConfigError(f"checkpoint.resume={resume}: no such checkpoint directory")
        saved = _owner_config(checkpoint, run_dir)
    where = f"checkpoint.resume={resume}"
    if saved is not None and saved.is_file():
        _check_same_meaning(cfg, saved, where)
    if checkpoint is not None and (meta := peek_meta(checkpoint)) is not None:
        # before the run writes its config.yaml: a refused resume leaves the run as it was
        check_recorded_meaning(cfg, meta.get("config"), where, checkpoint)
    if checkpoint is not None and (step := _marker_step(checkpoint)) is not None:
        check_within(step, cfg.train.steps, checkpoint)  # the loaded state's own step is checked by the resume
    if resume == "auto" and checkpoint is None and _records_steps(run_dir):
        return _start_over(run_dir)
    return None


def _check_is_directory(run_dir: Path) -> None:
    """``run_dir`` and the nearest of its parents that exists are directories."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} exists and is not a directory; choose another `name` or `log.dir`")
    parent = run_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"log.dir: {parent} is a file, not a directory, so the run directory {run_dir} "
                          "cannot be made there; choose another `log.dir`")


def _records_steps(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds metrics or samples of steps already run."""
    return any((run_dir / name).is_file() and (run_dir / name).stat().st_size > 0
               for name in ("metrics.jsonl", "samples.jsonl"))


def _start_over(run_dir: Path) -> str:
    """``resume=auto`` on a run that recorded steps but left no complete checkpoint (it
    stopped before its first): it starts from step 0, and what the earlier attempt wrote
    is moved aside, whole, rather than written over."""
    aside = _aside_name(run_dir)
    os.rename(run_dir, aside)
    return (f"checkpoint.resume=auto: {run_dir} holds no complete checkpoint to continue from; "
            f"moved what its earlier attempt wrote aside to {aside}; starting from step 0")


def peek_meta(checkpoint: Path) -> dict[str, Any] | None:
    """The ``meta`` of ``checkpoint`` as written, unverified and without its tensors, or
    None where it cannot be read (loading the checkpoint then says why)."""
    try:
        meta = json.loads((checkpoint / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _marker_step(checkpoint: Path) -> int | None:
    """The step ``checkpoint``'s marker records, or None where it cannot be read (loading
    the checkpoint then says why)."""
    try:
        return checkpoint_step(checkpoint)
    except CheckpointError:
        return None


def checkpoints_of(run_dir: Path) -> Path:
    """Where the run in ``run_dir`` keeps its checkpoints."""
    return run_dir / "checkpoints"


def _fresh(cfg: Config, run_dir: Path) -> str | None:
    if not _holds_files(run_dir):
        return None
    aside = _aside_name(run_dir)
    if not cfg.checkpoint.overwrite:
        raise ConfigError(
            f"run directory {run_dir} already holds a run (checkpoint.resume=never starts a new one); "
            f"choose another `name`, continue it with checkpoint.resume=auto, or move it aside to "
            f"{aside} and start afresh with checkpoint.overwrite=true"
        )
    os.rename(run_dir, aside)
    return f"moved the old run in {run_dir} aside to {aside}"


def _holds_files(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(run_dir.iterdir())


def _aside_name(run_dir: Path) -> Path:
    n = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    return aside


def _owner_config(checkpoint: Path, run_dir: Path) -> Path | None:
    """The saved config of the run ``checkpoint`` belongs to (``RUN/checkpoints/step-N``),
    or None for a checkpoint outside a run directory. A checkpoint of another run may only
    start a new directory: resumed into one holding a run, the two would mix."""
    owner = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if _holds_files(run_dir) and (owner is None or owner.resolve() != run_dir.resolve()):
        raise ConfigError(
            f"checkpoint.resume={checkpoint}: the run directory {run_dir} holds another run, whose "
            f"files would mix with this one's; choose another `name` for the run continuing from it"
        )
    return owner / RUN_CONFIG if owner is not None else None


def _check_same_meaning(cfg: Config, saved: Path, where: str) -> None:
    try:
        old = load_config(saved)
    except ConfigError as err:
        raise ConfigError(f"{where}: the run's saved config cannot be read to compare with: {err}") from None
    check_same_meaning(cfg, old, where, f"the run's ({saved})")
