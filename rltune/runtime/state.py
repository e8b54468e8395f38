"""Saving and restoring the whole state of a run: model, optimizer, schedule, every RNG,
the data position, the step and the learner's counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltune.checkpoint.state import (
    optimizer_from_state,
    optimizer_to_state,
    rng_from_state,
    rng_to_state,
    scheduler_from_state,
    scheduler_to_state,
)
from rltune.checkpoint.model import model_from_state, model_to_state
from rltune.checkpoint.rollouts import batches_from_state, batches_to_state
from rltune.checkpoint.sharded import FORMAT as SHARDED
from rltune.checkpoint.sharded import load_sharded, save_sharded
from rltune.checkpoint.store import (
    CheckpointError,
    Skipped,
    checkpoint_step,
    load_checkpoint,
    load_newest,
    save_checkpoint,
    set_aside,
)
from rltune.models.replay import forget
from rltune.runtime.resumable import REFERENCE, check_resumable
from rltune.runtime.rundir import check_recorded_meaning, checkpoints_of

if TYPE_CHECKING:
    from rltune.runtime.parts import Run


def checkpoint_root(run: "Run") -> Path:
    return checkpoints_of(run.run_dir)


def save(run: "Run") -> Path:
    """Checkpoint ``run`` at its current step (``RUN/checkpoints/step-N``). With rollouts
    ahead of the learner, the producer is held between batches meanwhile: the batches it
    queued, the sampler and the sampling RNG are saved as of one moment, after those batches."""
    with run.source.paused():
        return _save(run)


def _save(run: "Run") -> Path:
    roles, progress = run.roles, run.progress
    rng_tensors, rng_meta = rng_to_state(progress.streams.generators)
    shards = None
    if roles.learner.writes_shards:
        # the learner's ranks write their shards into the checkpoint's directory
        tensors, meta = {}, {}
        shards = partial(roles.learner.checkpoint_state, "")
    else:
        tensors, meta = roles.learner.checkpoint_state("")
    tensors["rng"] = rng_tensors
    meta.update({"step": progress.step, "name": run.cfg.name, "rng": rng_meta, "sampler": run.data.sampler.state_dict(),
                 "config": run.cfg.model_dump(mode="json")})  # what the run means, checked on resume
    if run.source.max_ahead:
        tensors["queue"], meta["queue"] = batches_to_state(run.source.queued(), run.data.train_prompts)
    if roles.critic is not None:
        critic_tensors, critic_meta = roles.critic.checkpoint_state("critic_")
        tensors.update(critic_tensors)
        meta.update(critic_meta)
    if roles.kl is not None:
        meta["kl_coef"] = roles.kl.coef
    if roles.reference is not None and (fingerprint := roles.reference.fingerprint()) is not None:
        meta[REFERENCE] = fingerprint  # a resume refuses other weights at model.path
    return save_checkpoint(checkpoint_root(run), progress.step, tensors=tensors, meta=meta,
                           keep=run.cfg.checkpoint.keep, shards=shards)


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor (in nested dicts, lists, tuples) on the CPU."""
    return map_tensors(lambda t: t.detach().cpu(), value)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(fn, v) for v in value)
    return value


def learner_state(learner, prefix: str) -> tuple[dict, dict]:
    """A learner's model, optimizer, schedule and counters, keys prefixed by ``prefix``."""
    opt_tensors, opt_meta = optimizer_to_state(learner.optimizer)
    model_tensors, model_meta = model_to_state(learner.model)
    tensors = {f"{prefix}model": model_tensors, f"{prefix}optimizer": opt_tensors}
    meta = {
        f"{prefix}model": model_meta,
        f"{prefix}optimizer": opt_meta,
        f"{prefix}scheduler": scheduler_to_state(learner.schedule),
        f"{prefix}learner": _counters(learner),
    }
    return tensors, meta


def sharded_learner_state(learner, prefix: str, directory: Path) -> tuple[dict, dict]:
    """:func:`learner_state` of a learner whose ranks hold shards (every rank calls it
    together): the model and optimizer go into ``directory/<prefix>learner`` with DCP
    (:func:`rltune.checkpoint.sharded.save_sharded`), each rank writing its own file; the
    returned tensors are empty and ``meta`` names that directory."""
    name = f"{prefix}learner"
    optimizer_meta = save_sharded(learner.model, learner.optimizer, Path(directory) / name)
    meta = {
        f"{prefix}model": {"format": SHARDED, "dir": name},
        f"{prefix}optimizer": optimizer_meta,
        f"{prefix}scheduler": scheduler_to_state(learner.schedule),
        f"{prefix}learner": _counters(learner),
    }
    return {}, meta


def _counters(learner) -> dict:
    return {
        "version": learner.version,
        "nonfinite_in_a_row": learner.nonfinite_in_a_row,
        "nonfinite_total": learner.nonfinite_total,
        # fp16's loss scaler (JSON: the scale and its growth tracker); {} otherwise
        "precision": learner.precision.state_dict(),
    }


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` did: the checkpoint the run continues from (None: it starts
    at step 0) and the checkpoints it skipped. True when a checkpoint was loaded."""

    path: Path | None = None
    step: int = 0
    skipped: tuple[Skipped, ...] = ()
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.path is not None

    def lines(self, total_steps: int) -> list[str]:
        """What the console says about it, one line per skipped checkpoint and one for the
        checkpoint resumed from."""
        fell_back = f"resuming from {self.path}" if self.path is not None else "starting from step 0"
        out = [f"skipped checkpoint {s.path} ({s.reason}); moved it to {s.moved_to}; {fell_back}"
               for s in self.skipped]
        if self.path is not None:
            out.append(f"resuming from {self.path} (step {self.step} of {total_steps})")
        return [*out, *self.notes]


def restore(run: "Run") -> Restored:
    """Apply ``checkpoint.resume``: ``never`` starts fresh, ``auto`` continues from the newest
    checkpoint of this run that verifies (moving newer unfinished or corrupt ones aside),
    anything else is a checkpoint path (moving this run's newer checkpoints aside)."""
    resume = run.cfg.checkpoint.resume
    if resume == "never":
        return Restored()
    if resume == "auto":
        loaded = load_newest(checkpoint_root(run))
        if loaded.path is None:
            return Restored(skipped=loaded.skipped)
        path, tensors, meta, skipped = loaded.path, loaded.tensors, loaded.meta, loaded.skipped
    else:
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume!r}: no such checkpoint directory")
        tensors, meta = load_checkpoint(path)
        skipped = ()
    check_recorded_meaning(run.cfg, meta.get("config"), f"checkpoint.resume={resume}", path)
    try:
        # before anything is loaded, and before the loop cuts the metrics back to the step
        notes = check_resumable(run, tensors, meta, path, marker_step=checkpoint_step(path))
        _apply(run, tensors, meta, path)
    except KeyError as err:  # the files verified, so they were written without it (or edited with their marker)
        raise CheckpointError(
            f"checkpoint {path} has no {err.args[0]!r} in its state; it was not written by a run of this "
            "config and version of rltune, or was edited"
        ) from None
    if resume != "auto":
        skipped = _set_aside_newer(checkpoint_root(run), path, run.step)
    return Restored(path, run.step, skipped, notes)


def _set_aside_newer(root: Path, path: Path, step: int) -> tuple[Skipped, ...]:
    """Resuming this run from one of its older checkpoints: the newer ones belong to the
    steps it is about to train again, so they are moved aside (``.skipped-step-N-newer``)
    and a later ``resume=auto`` cannot mix them in."""
    if not root.is_dir() or path.parent.resolve() != root.resolve():
        return ()
    newer = sorted((int(e.name[5:]), e) for e in root.iterdir() if e.name.startswith("step-")
                   and e.name[5:].isdigit() and int(e.name[5:]) > step)
    reason = f"newer than {path.name}, which checkpoint.resume names"
    return tuple(Skipped(e, set_aside(e, "newer"), reason) for _, e in reversed(newer))


def _apply(run: "Run", tensors: dict, meta: dict, path: Path) -> None:
    roles, progress = run.roles, run.progress
    roles.learner.load_checkpoint_state(tensors, meta, path, "")
    if roles.critic is not None:
        if "critic_model" not in tensors:
            raise CheckpointError(f"{path} holds no critic; it was not written by a run of algo {run.cfg.algo.name!r}")
        roles.critic.load_checkpoint_state(tensors, meta, path, "critic_")
    if roles.kl is not None:
        roles.kl.coef = float(meta["kl_coef"])
    try:
        rng_from_state(tensors["rng"], meta["rng"], progress.streams.generators)
    except CheckpointError as err:  # its message says "the checkpoint": name it
        raise CheckpointError(f"{path}: {err}") from None
    except (TypeError, ValueError) as err:  # a state random/numpy/torch refuse
        raise CheckpointError(f"checkpoint {path}: its RNG state cannot be restored ({err}); it was edited "
                              "or written by a faulty save; resume from another one (checkpoint.resume=PATH)") from None
    progress.streams.restored()  # streams that live in other processes take their states back
    try:
        run.data.sampler.load_state_dict(meta["sampler"])
    except ValueError as err:  # another seed or dataset: the user's to fix, shown without a traceback
        raise CheckpointError(f"{path}: {err}") from None
    progress.step = int(meta["step"])
    roles.sync_generator()
    _apply_queue(run, tensors, meta, path)


def _apply_queue(run: "Run", tensors: dict, meta: dict, path: Path) -> None:
    """Put back the batches generated ahead of the learner and not yet learned (a checkpoint
    written before they were saved has none: its sampler is before them, so they are
    generated again)."""
    queued = meta["queue"] if "queue" in meta else []
    if not run.source.max_ahead:
        if queued:
            raise CheckpointError(
                f"{path} holds {len(queued)} batch(es) generated ahead of the learner; resume it with the "
                f"runtime.max_staleness it was written with (this run has {run.cfg.runtime.max_staleness})"
            )
        return
    batches = batches_from_state(tensors["queue"] if queued else {}, queued, run.data.train_prompts, where=str(path))
    run.source.restore(batches, version=run.learner.version)


def apply_learner_state(learner, tensors: dict, meta: dict, path: Path, prefix: str) -> None:
    """Load what :func:`learner_state` or :func:`sharded_learner_state` wrote into
    ``learner`` (a sharded checkpoint into any layout, or into one process: every rank
    reads its part of the shards)."""
    model_meta = meta[f"{prefix}model"]
    if isinstance(model_meta, dict) and model_meta.get("format") == SHARDED:
        load_sharded(learner.model, learner.optimizer, Path(path) / model_meta["dir"], meta[f"{prefix}optimizer"])
    else:
        model_from_state(learner.model, tensors[f"{prefix}model"], model_meta, where=f"{path} ({prefix}model)")
        optimizer_from_state(learner.optimizer, tensors[f"{prefix}optimizer"], meta[f"{prefix}optimizer"])
    scheduler_from_state(learner.schedule, meta[f"{prefix}scheduler"])
    forget(learner.model)  # loaded in place: records of the weights before are stale
    counters = meta[f"{prefix}learner"]
    learner.version = counters["version"]
    learner.nonfinite_in_a_row = counters["nonfinite_in_a_row"]
    learner.nonfinite_total = counters["nonfinite_total"]
    learner.precision.load_state_dict(counters.get("precision", {}))  # absent: written before fp16 existed
