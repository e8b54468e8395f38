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

What may change on a resume is what does not change what the run learns or how its
figures are measured: logging, checkpointing, when evaluation runs, speed and memory
knobs, the runtime's layout, and ``train.steps`` to extend a run (except under a cosine
schedule, which decays over ``train.steps``). Everything else (model, algorithm, data,
rollout sampling, rewards, environment, optimizer, seed, ``runtime.max_staleness``,
held-out evaluation settings) is the run's meaning. A reward or environment named by a
file (``path/to/file.py:fn``) is compared by file name and function: a run copied to
another folder, or a config read from elsewhere, still resumes.
"""

from __future__ import annotations

import json
import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rltune.algos import ALGORITHMS
from rltune.algos.registry import unread_keys
from rltune.checkpoint.store import META_FILE, latest_checkpoint
from rltune.config import Config, ConfigError, load_config
from rltune.config.ignored import is_unread, unread_prefixes
from rltune.runtime.roles import plays_episodes

RUN_CONFIG = "config.yaml"

FREE_KEYS = (
    "name",  # the directory's name: a run moved aside continues under its new name
    "log.*",  # where and how metrics and samples are written
    "checkpoint.*",  # how often, how many kept, how to resume, the final export
    "eval.every",  # when held-out evaluation runs (not on what, nor how it samples)
    "eval.batch_size",
    "train.steps",  # extending a run; see _cosine_length for the exception
    "train.threads",  # speed and memory: the same sums, chunked differently
    "rollout.threads",  # the same: the producer thread's share of the cores
    "train.micro_batch_tokens",
    "train.logprob_chunk_tokens",
    "train.activation_checkpointing",  # memory: the same gradients, recomputed
    "train.checkpoint_every",
    "train.offload",  # memory: where the states wait between uses
    "train.compile",  # speed: the same arithmetic, fused
    "train.parallel.*",  # the learner's layout: a checkpoint loads into another one
    "train.max_nonfinite_steps",  # when to give up on a failing run
    "train.max_reward_error_steps",
    "model.trust_remote_code",  # a permission, not another model
    "rollout.engine",  # which engine samples, not what is sampled
    "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm.enforce_eager",
    "runtime.*",  # where the pieces run and how many workers (but see BOUND_KEYS)
    "reward.*.accuracy",  # whether an accuracy metric is logged
)
"""Dotted keys (``fnmatch`` patterns) a resumed run may change."""

BOUND_KEYS = ("runtime.max_staleness",)
"""Keys matched by :data:`FREE_KEYS` that still change the run's meaning: how far the
samples may lag the learner is part of the algorithm."""


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


def check_recorded_meaning(cfg: Config, recorded: Any, where: str, checkpoint: Path) -> None:
    """Compare ``cfg`` with the config a checkpoint recorded when it was saved (its
    ``meta["config"]``), by the same rules as the run's ``config.yaml``: the checkpoint
    carries what its run means, so editing or deleting ``config.yaml`` does not let a
    resume change it. A checkpoint without a record (written before they were) is not
    compared here."""
    if recorded is None:
        return
    try:
        old = Config.model_validate(recorded)
    except ValueError as err:
        raise ConfigError(
            f"{where}: the config recorded in checkpoint {checkpoint} cannot be read to compare with "
            f"({str(err).splitlines()[0]}); it was written by another version of rltune"
        ) from None
    try:  # the same JSON round trip as the record (an int dict key comes back a str, a date a string)
        mine = Config.model_validate(cfg.model_dump(mode="json"))
    except ValueError:
        mine = cfg
    check_same_meaning(mine, old, where, f"the one recorded in checkpoint {checkpoint}")


def check_same_meaning(cfg: Config, old: Config, where: str, whose: str) -> None:
    """Raise :class:`ConfigError` naming every key outside :data:`FREE_KEYS` where ``cfg``
    differs from ``old`` (``whose``: which config ``old`` is, for the message)."""
    unread = _unread(old, cfg)
    changed = [
        f"{key}: {_show(a)} -> {_show(b)}"
        for key, a, b in differences(old, cfg)
        if (not _free(key) or _cosine_length(key, old, cfg)) and not _same_function(key, a, b) and key not in unread
    ]
    if changed:
        raise ConfigError(
            f"{where}: this config differs from {whose} in what the run means: "
            f"{'; '.join(changed)}; resume with the run's values, or start a new run (another `name`)"
        )


def _unread(old: Config, new: Config) -> set[str]:
    """Keys the run of both configs reads in neither: a value it ignores is not the run's
    meaning (and one set in an old run, refused now, may then be dropped). The algorithm's
    keys (:func:`~rltune.algos.registry.unread_keys`) and the settings of
    :mod:`rltune.config.ignored`, of the keys where the two configs differ."""
    algorithm = ALGORITHMS.get(old.algo.name)
    if algorithm is None or new.algo.name != old.algo.name:
        return set()
    prefixes = [unread_prefixes(c, plays_episodes=plays_episodes(algorithm, c)) for c in (old, new)]
    settings = {key for key, _, _ in differences(old, new) if all(is_unread(key, p) for p in prefixes)}
    # the engine may change on a resume: the vLLM keys of a run that starts or stops using vLLM
    settings |= {key for key, _, _ in differences(old, new) if any(is_unread(key, p) for p in prefixes)
                 and key.startswith("rollout.vllm.")}
    return (set(unread_keys(algorithm, old)) & set(unread_keys(algorithm, new))) | settings


def _free(key: str) -> bool:
    return key not in BOUND_KEYS and any(fnmatchcase(key, pattern) for pattern in FREE_KEYS)


def _cosine_length(key: str, old: Config, new: Config) -> bool:
    """``train.steps`` is the length of a cosine schedule: changing it reshapes the lr of
    the steps still to come."""
    return key == "train.steps" and "cosine" in (old.train.schedule, new.train.schedule)


def _same_function(key: str, old: Any, new: Any) -> bool:
    """A reward or environment given as ``path/to/file.py:name`` is the same one when the
    file name and the name agree: the directory is where the project lives (a run copied
    elsewhere, a config given by another path), not which function it is."""
    if not (fnmatchcase(key, "reward.*.fn") or key == "env.name") or not (isinstance(old, str) and isinstance(new, str)):
        return False
    return _locator(old) == _locator(new)


def _locator(ref: str) -> str:
    where, _, name = ref.rpartition(":")
    return f"{Path(where).name}:{name}" if where.endswith(".py") else ref


def differences(old: BaseModel, new: BaseModel, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every field that differs, descending
    into sections and into lists of sections of the same length (``reward.0.fn``)."""
    out: list[tuple[str, Any, Any]] = []
    for name in type(new).model_fields:
        key, a, b = f"{prefix}{name}", getattr(old, name), getattr(new, name)
        if isinstance(a, BaseModel) and type(a) is type(b):
            out += differences(a, b, f"{key}.")
        elif _sections(a) and _sections(b) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                out += differences(x, y, f"{key}.{i}.")
        elif a != b:
            out.append((key, a, b))
    return out


def _sections(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, BaseModel) for v in value)


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump()
    elif _sections(value):
        value = [v.model_dump() for v in value]
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
