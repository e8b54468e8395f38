"""A learner rank's checkpoint part, in one of two formats.

* Sharded (DCP, :mod:`rltune.checkpoint.sharded`): a learner over a device mesh
  (``train.parallel``: tensor, pipeline, expert or sharded data parallelism) writes its
  shards into the checkpoint's directory, every rank its own file, nothing gathered.
* One file (:func:`rltune.runtime.state.learner_state`): DDP's rank 0 gives its
  replica; the FSDP2 strategy (``runtime.placement.learner_strategy: fsdp2``) gathers
  the full model and optimizer state to rank 0 (:func:`fsdp2_state`), and scatters them
  back to every rank's shards when loading (:func:`apply_fsdp2_state`).

Either loads into a group of any size or layout, or into one process.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rltune.checkpoint.sharded import FORMAT as SHARDED
from rltune.checkpoint.sharded import writes_shards
from rltune.checkpoint.store import CheckpointError
from rltune.learner.learner import LocalLearner
from rltune.models.lora import is_lora
from rltune.parallel.layout import LORA_LAYOUTS
from rltune.runtime.state import apply_learner_state, learner_state, map_tensors, sharded_learner_state, to_cpu


def rank_checkpoint_state(learner: LocalLearner, strategy: str, prefix: str,
                          directory: str | None) -> tuple[dict, dict] | None:
    """One rank's part in writing a checkpoint (every rank calls it together): with
    shards, each rank writes its own into ``directory`` (the checkpoint's unfinished
    directory, on a filesystem every rank and the driver share); otherwise rank 0 gives
    the one-file state (FSDP2: gathered from every rank). Rank 0 returns ``(tensors,
    meta)``, CPU tensors; the others None."""
    rank = learner.parallelism.rank
    if writes_shards(learner):
        if directory is None:
            raise CheckpointError("a sharded learner writes its checkpoint into a directory; none was given "
                                  "(rltune.checkpoint.store.save_checkpoint's `shards` passes it)")
        state = sharded_learner_state(learner, prefix, Path(directory))
        return state if rank == 0 else None
    state = fsdp2_state(learner, prefix) if strategy == "fsdp2" else (
        to_cpu(learner_state(learner, prefix)) if rank == 0 else None)
    return None if state is None else _apart_from(learner, state)


def _apart_from(learner: LocalLearner, state: tuple[dict, dict]) -> tuple[dict, dict]:
    """``state`` with every tensor that shares memory with ``learner``'s parameters or
    optimizer state copied, so that the learner's later steps do not change it.

    A state dict on the CPU hands out the live tensors where it has nothing to gather or
    move: every tensor of a CPU learner's one-file state, and under FSDP2 the optimizer's
    unsharded ``step`` counters (the gathered parameters and moments are new tensors and
    are not copied again). A caller that keeps the state while the learner steps on (a
    checkpoint written later, a load in the same process) would otherwise read a later
    ``step``: Adam's bias correction, and so the resumed update, would differ."""
    live = {_storage(t) for t in learner.model.parameters()}
    live |= {_storage(v) for entry in learner.optimizer.state.values() for v in entry.values()
             if isinstance(v, torch.Tensor)}

    return map_tensors(lambda t: t.clone() if _storage(t) in live else t, state)


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory ``tensor`` (its local shard, for a DTensor) lives in."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def rank_load_checkpoint_state(learner: LocalLearner, strategy: str, tensors: dict, meta: dict,
                               path: Path, prefix: str) -> None:
    """One rank's part in loading a checkpoint of either format (every rank together):
    a sharded one by name into whatever this rank holds; a one-file one scattered to the
    shards (a mesh layout or FSDP2) or loaded whole (one process, DDP)."""
    model_meta = meta.get(f"{prefix}model")
    sharded = isinstance(model_meta, dict) and model_meta.get("format") == SHARDED
    if not sharded and (strategy == "fsdp2" or writes_shards(learner)):
        apply_fsdp2_state(learner, tensors, meta, path, prefix)
    else:
        apply_learner_state(learner, tensors, meta, path, prefix)


def fsdp2_state(learner: LocalLearner, prefix: str) -> tuple[dict, dict] | None:
    """:func:`learner_state` of an FSDP2 learner on rank 0 (None on the others): the full
    model and optimizer state dicts are gathered to rank 0's CPU, the optimizer's state
    then keyed by parameter index as ``torch.optim.Optimizer.state_dict`` keys it, so the
    result has a ``LocalLearner``'s format and loads into either (or into a group of
    another size or strategy)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    _refuse_fsdp2_lora(learner)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(learner.model, options=options)
    # before the first step the optimizer has no state, and gathering it would create one
    # (torch initialises it with a zero-gradient step); every rank has stepped as often
    optim_state = (get_optimizer_state_dict(learner.model, learner.optimizer, options=options)
                   if learner.optimizer.state else {"state": {}})
    if learner.parallelism.rank != 0:
        return None
    index = {name: i for i, name in enumerate(_param_names(learner))}
    by_index = {
        "state": {index[name]: state for name, state in optim_state["state"].items()},
        # the live optimizer's own groups: the same on every rank, numbered as saved here
        "param_groups": learner.optimizer.state_dict()["param_groups"],
    }
    view = types.SimpleNamespace(
        model=_ModelView(model_state), optimizer=_OptimizerView(by_index, None), schedule=learner.schedule,
        version=learner.version, nonfinite_in_a_row=learner.nonfinite_in_a_row,
        nonfinite_total=learner.nonfinite_total, precision=learner.precision,
    )
    return learner_state(view, prefix)


def apply_fsdp2_state(learner: LocalLearner, tensors: dict, meta: dict, path: Path, prefix: str) -> None:
    """:func:`apply_learner_state` for an FSDP2 learner: the checks and the scheduler and
    counters as there; each rank then takes its shards of the full state dicts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _refuse_fsdp2_lora(learner)
    model_view = _ModelView(learner.model.state_dict(), tied_from=learner.model)
    optimizer_view = _OptimizerView(None, learner.optimizer)
    view = types.SimpleNamespace(model=model_view, optimizer=optimizer_view, schedule=learner.schedule,
                                 precision=learner.precision)
    apply_learner_state(view, tensors, meta, path, prefix)
    names = _param_names(learner)
    loaded = optimizer_view.loaded
    by_name = {
        "state": {names[int(i)]: state for i, state in loaded["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in loaded["param_groups"]],
    }
    # strict=False: the checks above allow a checkpoint without a tied weight's second name
    set_model_state_dict(learner.model, model_view.loaded, options=StateDictOptions(full_state_dict=True, strict=False))
    if by_name["state"]:
        set_optimizer_state_dict(learner.model, learner.optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))
    else:  # saved before the first step: no state, as Optimizer.load_state_dict would leave it
        learner.optimizer.state.clear()
    # the hyperparameters as Optimizer.load_state_dict leaves them (set_optimizer_state_dict
    # turns tuples such as ``betas`` into lists)
    for live, saved in zip(learner.optimizer.param_groups, loaded["param_groups"]):
        live.update({key: value for key, value in saved.items() if key != "params"})
    learner.version = view.version
    learner.nonfinite_in_a_row = view.nonfinite_in_a_row
    learner.nonfinite_total = view.nonfinite_total


def _refuse_fsdp2_lora(learner: LocalLearner) -> None:
    if is_lora(learner.model):
        raise CheckpointError(
            "checkpoints of a LoRA model sharded with FSDP2 are not supported (its checkpoint "
            "holds only the adapters and a fingerprint of the frozen weights, which the "
            f"sharded model cannot give); {LORA_LAYOUTS}"
        )


def _param_names(learner: LocalLearner) -> list[str]:
    """The names of the optimizer's parameters, in the order that numbers them in
    ``optimizer.state_dict()``."""
    name_of = {id(p): name for name, p in learner.model.named_parameters()}
    return [name_of[id(p)] for group in learner.optimizer.param_groups for p in group["params"]]


class _ModelView:
    """Stands in for a sharded model where :mod:`rltune.checkpoint.model` expects a plain
    one: ``state_dict()`` gives ``state`` (full tensors when saving; the sharded model's
    own, whose shapes and dtypes are the full ones, when loading), and ``load_state_dict``
    keeps what it is given in ``loaded``. With ``tied_from``, ``state_dict(keep_vars=True)``
    gives one small tensor per distinct entry of that model, so that names sharing a
    tensor (tied weights) share a data pointer as in a plain model."""

    def __init__(self, state: Mapping[str, torch.Tensor], tied_from: torch.nn.Module | None = None) -> None:
        self.state = dict(state)
        self.loaded: dict[str, torch.Tensor] = {}
        if tied_from is None:
            self.vars = self.state
        else:
            live = tied_from.state_dict(keep_vars=True)
            tokens: dict[int, torch.Tensor] = {}
            self.vars = {name: tokens.setdefault(id(value), torch.empty(1)) for name, value in live.items()}

    def state_dict(self, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return self.vars if keep_vars else self.state

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        self.loaded = dict(state)


class _OptimizerView:
    """Stands in for an FSDP2 learner's optimizer where :mod:`rltune.checkpoint.state`
    expects one: ``state_dict()`` gives ``state`` (saving) or the live optimizer's own,
    whose param groups are the template (loading); ``load_state_dict`` keeps its argument."""

    def __init__(self, state: dict | None, live: torch.optim.Optimizer | None) -> None:
        self.state, self.live = state, live
        self.loaded: dict = {}

    def state_dict(self) -> dict:
        return self.state if self.state is not None else self.live.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
