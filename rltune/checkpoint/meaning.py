"""What a run means: the config keys that must not change when a checkpoint is continued
(a resume) or its model written out (``rltune export``).

A checkpoint records the config of the run that wrote it (``meta["config"]``). A resume
compares it, and the run's ``config.yaml``, with the config it is given; an export
compares it with the ``config.yaml`` of the run it is asked to export. Every difference
outside :data:`FREE_KEYS` is the run's meaning: another model, algorithm, data, rollout
sampling, rewards, environment, optimizer, seed, ``runtime.max_staleness`` or held-out
evaluation settings. What may differ is what does not change what the run learns or how
its figures are measured: logging, checkpointing, when evaluation runs, speed and memory
knobs, the runtime's layout, and ``train.steps`` to extend a run (except under a cosine
schedule, which decays over ``train.steps``). A reward or environment named by a file
(``path/to/file.py:fn``) is compared by file name and function: a run copied to another
folder, or a config read from elsewhere, still matches.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rltune.algos import ALGORITHMS, Algorithm
from rltune.algos.registry import unread_keys
from rltune.config import Config, ConfigError
from rltune.config.ignored import is_unread, unread_prefixes
from rltune.learner.preference import PREFERENCE_METHODS

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
    "train.reuse_rollout_mb",  # speed: the decode's products instead of recomputed ones
    "algo.skip_zero_advantage",  # speed: the same update without the zero-advantage rows' backward
    "rollout.compile",  # speed: the same decode step, compiled
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


def is_preference(cfg: Config) -> bool:
    """An offline run on preference pairs (DPO, SimPO, reward model)."""
    return cfg.algo.name in PREFERENCE_METHODS


def plays_episodes(algorithm: Algorithm, cfg: Config) -> bool:
    """Whether the run's generator plays an environment's episodes: an online algorithm
    does, and SFT when it evaluates on ``data.eval``; a preference method never generates."""
    return algorithm.online or (not is_preference(cfg) and cfg.data.eval is not None)


def recorded_config(recorded: Any, where: str, checkpoint: Path) -> Config | None:
    """The config a checkpoint recorded (its ``meta["config"]``) as a :class:`Config`; None
    for a checkpoint without a record (written before they were). A ConfigError (``where``
    starts it) when the record cannot be read by this version of rltune."""
    if recorded is None:
        return None
    try:
        return Config.model_validate(recorded)
    except ValueError as err:
        raise ConfigError(
            f"{where}: the config recorded in checkpoint {checkpoint} cannot be read to compare with "
            f"({str(err).splitlines()[0]}); it was written by another version of rltune"
        ) from None


def as_recorded(cfg: Config) -> Config:
    """``cfg`` after the JSON round trip a record goes through (an int dict key comes back
    a str, a date a string), so that it compares equal to its own record."""
    try:
        return Config.model_validate(cfg.model_dump(mode="json"))
    except ValueError:
        return cfg


def check_recorded_meaning(cfg: Config, recorded: Any, where: str, checkpoint: Path) -> None:
    """Compare ``cfg`` with the config a checkpoint recorded when it was saved (its
    ``meta["config"]``), by the same rules as the run's ``config.yaml``: the checkpoint
    carries what its run means, so editing or deleting ``config.yaml`` does not let a
    resume change it. A checkpoint without a record (written before they were) is not
    compared here."""
    old = recorded_config(recorded, where, checkpoint)
    if old is not None:
        check_same_meaning(as_recorded(cfg), old, where, f"the one recorded in checkpoint {checkpoint}")


def check_same_meaning(cfg: Config, old: Config, where: str, whose: str) -> None:
    """Raise :class:`ConfigError` naming every key outside :data:`FREE_KEYS` where ``cfg``
    differs from ``old`` (``whose``: which config ``old`` is, for the message)."""
    changed = meaning_changes(old, cfg)
    if changed:
        raise ConfigError(
            f"{where}: this config differs from {whose} in what the run means: "
            f"{'; '.join(changed)}; resume with the run's values, or start a new run (another `name`)"
        )


def meaning_changes(old: Config, new: Config) -> list[str]:
    """``KEY: OLD -> NEW`` for every key outside :data:`FREE_KEYS` where ``new`` differs
    from ``old`` in what the run means."""
    unread = _unread(old, new)
    return [
        f"{key}: {_show(a)} -> {_show(b)}"
        for key, a, b in differences(old, new)
        if (not _free(key) or _cosine_length(key, old, new)) and not _same_function(key, a, b) and key not in unread
    ]


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
