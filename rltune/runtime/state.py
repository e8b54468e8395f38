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
from rltune.checkpoint.store import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from rltune.runtime.loop import Run


def checkpoint_root(run: "Run") -> Path:
    return run.run_dir / "checkpoints"


def save(run: "Run") -> Path:
    """Checkpoint ``run`` at its current step (``RUN/checkpoints/step-N``)."""
    learner = run.learner
    opt_tensors, opt_meta = optimizer_to_state(learner.optimizer)
    rng_tensors, rng_meta = rng_to_state(run.state.generators)
    meta = {
        "step": run.step,
        "name": run.cfg.name,
        "optimizer": opt_meta,
        "scheduler": scheduler_to_state(learner.schedule),
        "rng": rng_meta,
        "sampler": run.sampler.state_dict(),
        "learner": {
            "version": learner.version,
            "nonfinite_in_a_row": learner.nonfinite_in_a_row,
            "nonfinite_total": learner.nonfinite_total,
        },
    }
    tensors = {"model": learner.model.state_dict(), "optimizer": opt_tensors, "rng": rng_tensors}
    return save_checkpoint(checkpoint_root(run), run.step, tensors=tensors, meta=meta, keep=run.cfg.checkpoint.keep)


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
    missing, unexpected = learner.model.load_state_dict(tensors["model"], strict=False)
    # tied weights are stored once; anything else missing means a different model
    missing = [k for k in missing if k not in _tied_keys(learner.model)]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the checkpoint does not match model.path={run.cfg.model.path!r} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    optimizer_from_state(learner.optimizer, tensors["optimizer"], meta["optimizer"])
    scheduler_from_state(learner.schedule, meta["scheduler"])
    rng_from_state(tensors["rng"], meta["rng"], run.state.generators)
    try:
        run.sampler.load_state_dict(meta["sampler"])
    except ValueError as err:  # another seed or dataset: the user's to fix, shown without a traceback
        raise CheckpointError(f"{path}: {err}") from None
    learner.version = meta["learner"]["version"]
    learner.nonfinite_in_a_row = meta["learner"]["nonfinite_in_a_row"]
    learner.nonfinite_total = meta["learner"]["nonfinite_total"]
    run.step = int(meta["step"])
    run.generator.load_weights(learner.version, None if run.shared_weights else learner.export_weights())


def _tied_keys(model) -> set[str]:
    """Parameter names that share storage with an earlier name (e.g. a tied lm_head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            tied.add(name)
        else:
            seen[ptr] = name
    return tied
