"""Checks of a checkpoint's state before a run continues from it (``runtime/state.py``).

The files of a checkpoint verify against their checksums, so what is checked here is
what a checksum cannot catch: a ``state.json`` written by a faulty save, or edited with
its marker. Every check runs before the checkpoint's state is loaded into the run and
before the loop cuts ``metrics.jsonl`` and ``samples.jsonl`` back to its step (the step
against ``train.steps`` also before the run writes its ``config.yaml``:
``runtime/rundir.py``), and names the checkpoint and the entry at fault:

- the step: a whole number, the step of ``COMPLETE`` (and so of the ``step-N`` name), and
  at most ``train.steps``;
- the learners' counters (policy version, non-finite steps, fp16 loss scale), the LR
  schedule's position and the optimizer's hyper-parameters: numbers of the right kind;
- that the checkpoint holds what this run's algorithm writes and nothing else it would
  not: a critic (PPO), an in-reward KL coefficient, a KL reference;
- the KL reference's fingerprint (:func:`~rltune.checkpoint.model.frozen_fingerprint` of
  the frozen copy of ``model.path``), recorded at every save, against the reference this
  run loaded: the policy continues from the checkpoint, the reference is loaded again
  from ``model.path``, and a changed ``model.path`` would change the KL term silently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.checkpoint.model import ADAPTERS
from rltune.checkpoint.store import META_FILE, MARKER, CheckpointError

if TYPE_CHECKING:
    from rltune.runtime.parts import Run

REFERENCE = "reference"
"""``meta`` key of the KL reference's fingerprint."""

CRITIC_PREFIX = "critic_"

_GROUP_NUMBERS = ("lr", "initial_lr", "eps", "weight_decay")
"""An optimizer param group's entries that are numbers >= 0 (AdamW's)."""
_GROUP_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                "decoupled_weight_decay")
"""An optimizer param group's entries that are True, False or None (AdamW's)."""


def check_resumable(run: "Run", tensors: Mapping[str, Any], meta: Mapping[str, Any], path: Path, *,
                    marker_step: int) -> tuple[str, ...]:
    """Raise CheckpointError when checkpoint ``path`` (its ``tensors`` and ``meta``; its
    ``COMPLETE`` records ``marker_step``) cannot be continued by ``run`` as it is built.
    Returns lines for the console (a checkpoint written before the KL reference was
    recorded). A KeyError names an entry missing from ``meta`` (the step); the other
    missing entries are left to the loading, which names them too."""
    check_step(meta, path, marker_step=marker_step, total=run.cfg.train.steps)
    prefixes = ("", CRITIC_PREFIX) if run.roles.critic is not None else ("",)
    for prefix in prefixes:
        check_learner_meta(meta, path, prefix)
    _check_roles(run, tensors, meta, path)
    return _check_reference(run, meta, path)


def check_step(meta: Mapping[str, Any], path: Path, *, marker_step: int, total: int) -> int:
    """The step ``meta`` holds, checked: a whole number, ``marker_step`` (what the marker
    and the directory's name say), and not past ``total`` (``train.steps``). A KeyError
    when it has none."""
    step = meta["step"]
    if not _whole(step):
        raise CheckpointError(f"checkpoint {path}: {META_FILE} has step {step!r}, not a whole number >= 0; "
                              f"{_another()}")
    if step != marker_step:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} says step {step} but {MARKER} says {marker_step}; "
                              f"{_another()}")
    check_within(step, total, path)
    return step


def check_within(step: int, total: int, path: Path) -> None:
    """A checkpoint of step ``step`` past ``train.steps`` (``total``) has nothing to train:
    refused, rather than a run that trains nothing and writes its final model again."""
    if step > total:
        raise CheckpointError(
            f"checkpoint {path} is at step {step}, past train.steps={total}: there is nothing left to train; "
            f"to continue the run set train.steps above {step}; to write out its model use "
            f"`rltune export RUN OUT --checkpoint {path}`"
        )


def check_learner_meta(meta: Mapping[str, Any], path: Path, prefix: str) -> None:
    """The counters, schedule and optimizer hyper-parameters of the learner ``prefix``
    (``""``: the policy; ``"critic_"``: PPO's critic) are numbers of the right kind."""
    where = f"checkpoint {path}: {META_FILE}'s"
    counters = meta.get(f"{prefix}learner")
    if isinstance(counters, Mapping):
        for key in ("version", "nonfinite_in_a_row", "nonfinite_total"):
            if key in counters and not _whole(counters[key]):
                raise CheckpointError(f"{where} {prefix}learner.{key} is {counters[key]!r}, not a whole number >= 0; "
                                      f"{_another()}")
        _check_precision(counters.get("precision"), f"{where} {prefix}learner.precision")
    elif counters is not None:
        raise CheckpointError(f"{where} {prefix}learner is {counters!r}, not an object; {_another()}")
    _check_scheduler(meta.get(f"{prefix}scheduler"), f"{where} {prefix}scheduler")
    optimizer = meta.get(f"{prefix}optimizer")
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("param_groups"), list):
        for i, group in enumerate(optimizer["param_groups"]):
            _check_group(group, f"{where} {prefix}optimizer.param_groups[{i}]")


def _check_precision(state: Any, where: str) -> None:
    if not state:  # {} or absent: no fp16 loss scale
        return
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where} is {state!r}, not an object; {_another()}")
    scale = state.get("scale")
    if "scale" in state and not (_number(scale) and scale > 0):
        raise CheckpointError(f"{where}.scale is {scale!r}, not a number > 0; {_another()}")
    for key in ("growth_tracker", "overflows"):
        if key in state and not _whole(state[key]):
            raise CheckpointError(f"{where}.{key} is {state[key]!r}, not a whole number >= 0; {_another()}")


def _check_scheduler(state: Any, where: str) -> None:
    """The LR schedule's position (``last_epoch``: updates taken) and its learning rates."""
    if state is None:
        return
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where} is {state!r}, not an object; {_another()}")
    for key in ("last_epoch", "_step_count"):
        if key in state and not _whole(state[key]):
            raise CheckpointError(f"{where}.{key} is {state[key]!r}, not a whole number >= 0; {_another()}")
    for key in ("base_lrs", "_last_lr"):
        values = state.get(key, [])
        if not isinstance(values, list) or not all(_number(v) and v >= 0 for v in values):
            raise CheckpointError(f"{where}.{key} is {values!r}, not a list of numbers >= 0; {_another()}")


def _check_group(group: Any, where: str) -> None:
    """One optimizer param group: its learning rate and the other AdamW numbers, its
    betas and its flags."""
    if not isinstance(group, Mapping):
        raise CheckpointError(f"{where} is {group!r}, not an object; {_another()}")
    for key in _GROUP_NUMBERS:
        if key in group and not (_number(group[key]) and group[key] >= 0):
            raise CheckpointError(f"{where}.{key} is {group[key]!r}, not a number >= 0; {_another()}")
    betas = group.get("betas", [0.0, 0.0])
    if not (isinstance(betas, list) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
        raise CheckpointError(f"{where}.betas is {betas!r}, not two numbers in [0, 1); {_another()}")
    for key in _GROUP_FLAGS:
        if key in group and group[key] not in (True, False, None):
            raise CheckpointError(f"{where}.{key} is {group[key]!r}, not true, false or null; {_another()}")


def _check_roles(run: "Run", tensors: Mapping[str, Any], meta: Mapping[str, Any], path: Path) -> None:
    """The checkpoint holds no state of a role this run does not have: written by another
    algorithm (its config record, when it has one, says so first)."""
    algo = run.cfg.algo.name
    critic = sorted(k for k in (*tensors, *meta) if k.startswith(CRITIC_PREFIX))
    if critic and run.roles.critic is None:
        raise CheckpointError(
            f"checkpoint {path} holds a critic ({', '.join(critic[:2])}), which only an algorithm with a value "
            f"model (ppo) writes; it was not written by a run of algo {algo!r}"
        )
    if "kl_coef" in meta:
        if run.roles.kl is None:
            raise CheckpointError(
                f"checkpoint {path} holds an in-reward KL coefficient (kl_coef), which only a run with "
                f"algo.kl_in_reward writes; it was not written by a run of this config (algo {algo!r})"
            )
        if not (_number(meta["kl_coef"]) and meta["kl_coef"] >= 0):
            raise CheckpointError(f"checkpoint {path}: {META_FILE}'s kl_coef is {meta['kl_coef']!r}, "
                                  f"not a number >= 0; {_another()}")
    if REFERENCE in meta and run.roles.reference is None:
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a KL reference (algo.kl_coef > 0), and this run has "
            f"none (algo {algo!r}, algo.kl_coef={run.cfg.algo.kl_coef}); resume it with the run's settings"
        )


def _check_reference(run: "Run", meta: Mapping[str, Any], path: Path) -> tuple[str, ...]:
    """Compare the KL reference recorded in the checkpoint with the one this run loaded."""
    reference = run.roles.reference
    mine = reference.fingerprint() if reference is not None else None
    if mine is None:  # no reference, or LoRA's base with adapters off (the adapters' own fingerprint covers it)
        return ()
    model_path = run.cfg.model.path
    if REFERENCE not in meta:
        model = meta.get("model")
        if isinstance(model, Mapping) and model.get("format") == ADAPTERS:
            return ()
        return (f"note: checkpoint {path} records no fingerprint of the KL reference (it was written by an "
                f"earlier rltune); the reference is the model at model.path={model_path} as it is now, unchecked",)
    if meta[REFERENCE] != mine:
        raise CheckpointError(
            f"checkpoint {path}: the KL reference loaded from model.path={model_path} is not the one the run "
            f"started from (its weights fingerprint differs from the one recorded at the save): the weights "
            f"there were changed since (overwritten by another run, or another model copied there); put "
            f"back the weights the run started from, or start a new run (another `name`) from the new ones"
        )
    return ()


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _another() -> str:
    return ("the checkpoint was edited or written by a faulty save; resume from another one "
            "(checkpoint.resume=PATH)")
