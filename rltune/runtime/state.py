"""Saving and restoring the whole state of a run: model, optimizer, schedule, every RNG,
the data position, the step and the learner's counters."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rltune.checkpoint.state import (
    optimizer_from_state,
    optimizer_to_state,
    rng_from_state,
    rng_to_state,
    scheduler_from_state,
    scheduler_to_state,
)
from rltune.checkpoint.model import model_from_state, model_to_state
from rltune.checkpoint.store import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from rltune.runtime.loop import Run


def checkpoint_root(run: "Run") -> Path:
    return checkpoints_of(run.run_dir)


def checkpoints_of(run_dir: Path) -> Path:
    """Where the run in ``run_dir`` keeps its checkpoints."""
    return run_dir / "checkpoints"


def save(run: "Run") -> Path:
    """Checkpoint ``run`` at its current step (``RUN/checkpoints/step-N``)."""
    rng_tensors, rng_meta = rng_to_state(run.state.generators)
    tensors, meta = _learner_state(run.learner, "")
    tensors["rng"] = rng_tensors
    # with rollouts ahead of the learner: the sampler before the oldest batch not yet
    # learned, so a resumed run generates those prompts again (each once)
    sampler = run.rollouts.sampler_state() if run.rollouts is not None else run.sampler.state_dict()
    meta.update({"step": run.step, "name": run.cfg.name, "rng": rng_meta, "sampler": sampler})
    if run.critic is not None:
        critic_tensors, critic_meta = _learner_state(run.critic, "critic_")
        tensors.update(critic_tensors)
        meta.update(critic_meta)
    if run.kl is not None:
        meta["kl_coef"] = run.kl.coef
    return save_checkpoint(checkpoint_root(run), run.step, tensors=tensors, meta=meta, keep=run.cfg.checkpoint.keep)


def _learner_state(learner, prefix: str) -> tuple[dict, dict]:
    """A learner's checkpoint part: its own ``checkpoint_state(prefix)`` when it has one (a
    learner whose model lives in other processes), else :func:`learner_state`."""
    own = getattr(learner, "checkpoint_state", None)
    return own(prefix) if own is not None else learner_state(learner, prefix)


def learner_state(learner, prefix: str) -> tuple[dict, dict]:
    """A learner's model, optimizer, schedule and counters, keys prefixed by ``prefix``."""
    opt_tensors, opt_meta = optimizer_to_state(learner.optimizer)
    model_tensors, model_meta = model_to_state(learner.model)
    tensors = {f"{prefix}model": model_tensors, f"{prefix}optimizer": opt_tensors}
    meta = {
        f"{prefix}model": model_meta,
        f"{prefix}optimizer": opt_meta,
        f"{prefix}scheduler": scheduler_to_state(learner.schedule),
        f"{prefix}learner": {
            "version": learner.version,
            "nonfinite_in_a_row": learner.nonfinite_in_a_row,
            "nonfinite_total": learner.nonfinite_total,
        },
    }
    return tensors, meta


def restore(run: "Run") -> bool:
    """Apply ``checkpoint.resume``: ``never`` starts fresh, ``auto`` continues from the newest
    complete checkpoint of this run if there is one, anything else is a checkpoint path.
    Returns whether a checkpoint was loaded."""
    resume = run.cfg.checkpoint.resume
    if resume == "never":
        return False
    if resume == "auto":
        path = latest_checkpoint(checkpoint_root(run))
        if path is None:
            return False
    else:
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume!r}: no such checkpoint directory")
    tensors, meta = load_checkpoint(path)
    _apply(run, tensors, meta, path)
    return True


def _apply(run: "Run", tensors: dict, meta: dict, path: Path) -> None:
    learner = run.learner
    _apply_learner(learner, tensors, meta, path, "")
    if run.critic is not None:
        if "critic_model" not in tensors:
            raise CheckpointError(f"{path} holds no critic; it was not written by a run of algo {run.cfg.algo.name!r}")
        _apply_learner(run.critic, tensors, meta, path, "critic_")
    if run.kl is not None:
        run.kl.coef = float(meta["kl_coef"])
    rng_from_state(tensors["rng"], meta["rng"], run.state.generators)
    restored = getattr(run.state, "restored", None)
    if restored is not None:  # streams that live in other processes take their states back
        restored()
    try:
        run.sampler.load_state_dict(meta["sampler"])
    except ValueError as err:  # another seed or dataset: the user's to fix, shown without a traceback
        raise CheckpointError(f"{path}: {err}") from None
    run.step = int(meta["step"])
    if run.generator is not None:
        run.generator.load_weights(learner.version, None if run.shared_weights else learner.export_weights())


def _apply_learner(learner, tensors: dict, meta: dict, path: Path, prefix: str) -> None:
    own = getattr(learner, "load_checkpoint_state", None)
    if own is not None:
        own(tensors, meta, path, prefix)
    else:
        apply_learner_state(learner, tensors, meta, path, prefix)


def apply_learner_state(learner, tensors: dict, meta: dict, path: Path, prefix: str) -> None:
    """Load what :func:`learner_state` wrote into ``learner``."""
    model_from_state(learner.model, tensors[f"{prefix}model"], meta[f"{prefix}model"], where=f"{path} ({prefix}model)")
    optimizer_from_state(learner.optimizer, tensors[f"{prefix}optimizer"], meta[f"{prefix}optimizer"])
    scheduler_from_state(learner.schedule, meta[f"{prefix}scheduler"])
    counters = meta[f"{prefix}learner"]
    learner.version = counters["version"]
    learner.nonfinite_in_a_row = counters["nonfinite_in_a_row"]
    learner.nonfinite_total = counters["nonfinite_total"]
