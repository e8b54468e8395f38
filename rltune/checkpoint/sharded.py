"""Sharded checkpoints of a learner group (``torch.distributed.checkpoint``, DCP): every
rank writes the shards it holds, none gathers the model; a checkpoint written by one
layout loads into any other, or into one process.

Why it reshards: DCP names every tensor by its fully-qualified name in the *unwrapped*
model (``model.layers.0.self_attn.q_proj.weight``) and records, for each saved chunk,
where it sits in the full tensor. A loading rank asks for the region its own layout
holds (a row block under FSDP2, a column block under tensor parallelism, the whole
tensor in one process) and DCP reads the overlapping pieces of whichever chunks cover
it. Names must therefore not depend on the layout: pipeline stages and expert
parallelism keep the original module names (a stage deletes the layers it does not
run; it does not renumber the ones it keeps).

On disk, ``DIR/`` holds one safetensors file per writing rank
(``HuggingFaceStorageWriter`` with ``save_distributed``): each file's header records
its tensors' offsets in the full tensor, and the reader rebuilds the layout from those
headers. No pickle anywhere (the default ``FileSystemWriter`` pickles its
``.metadata``). Only tensors go through DCP; the optimizer's hyperparameters and any
non-tensor state are JSON (:func:`save_sharded` returns them for ``state.json``).

Names inside DCP: ``model.<fqn>`` for the weights, ``optimizer.<fqn>.<name>`` for each
parameter's optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rltune.checkpoint.store import CheckpointError, check_json
from rltune.models.lora import is_lora
from rltune.parallel.layout import LORA_LAYOUTS

FORMAT = "dcp"
"""``meta[...model]["format"]`` of a sharded checkpoint (beside ``full`` and
``lora-adapters`` of :mod:`rltune.checkpoint.model`)."""
MODEL = "model."
OPTIMIZER = "optimizer."
_SHARD_FILE = re.compile(r"shard-\d+-model-\d+-of-\d+\.safetensors")


def refuse_lora(model: torch.nn.Module, where: str) -> None:
    """A LoRA model's checkpoint holds only its adapters and a fingerprint of the frozen
    base (:mod:`rltune.checkpoint.model`); a sharded model cannot give that fingerprint
    without gathering the base, so sharded LoRA checkpoints are refused, here, clearly."""
    if is_lora(model):
        raise CheckpointError(
            f"{where}: sharded checkpoints of a LoRA model are not supported (its checkpoint holds the "
            f"adapters and a fingerprint of the frozen weights, which a sharded model cannot give); {LORA_LAYOUTS}"
        )


def writes_shards(learner: Any) -> bool:
    """Whether ``learner`` (a :class:`~rltune.learner.learner.LocalLearner`) checkpoints
    in shards: any parallelism over a device mesh does (tensor, pipeline, expert or
    sharded data parallelism: each rank holds a part of the state). One process and DDP
    hold the whole model and write the one-file format; the FSDP2 strategy of
    ``runtime.placement.learner_strategy`` keeps the gathered one-file format it always
    wrote (``rltune/runtime/ray/fsdp_state.py``), so its checkpoints stay readable as
    before."""
    from rltune.learner.parallel import DDP, FSDP2, NoParallelism

    return not isinstance(learner.parallelism, (NoParallelism, DDP, FSDP2))


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict[str, Any]:
    """Write ``model``'s weights and ``optimizer``'s state into ``directory`` with DCP;
    every rank of the group calls it together (one process: alone). Each rank writes
    only what it holds; tensors replicated over ranks are written once.

    Returns the JSON part (the same on every rank): ``{"format": "dcp",
    "param_groups": [...], "state": {fqn: {non-tensor entries}}, "stepped": bool}``,
    param groups listing parameters by name. ``stepped`` False: saved before the first
    optimizer step, with no optimizer state (gathering it would make torch initialise one
    with a zero-gradient step, which changes AdamW's step count).
    """
    refuse_lora(model, str(directory))
    model_sd = get_model_state_dict(model)
    tied = aliases(model_sd)
    tensors = {MODEL + k: v for k, v in model_sd.items() if k not in tied}
    meta: dict[str, Any] = {"format": FORMAT, "stepped": bool(optimizer.state), "state": {}, "tied": tied}
    if optimizer.state:
        optim = get_optimizer_state_dict(model, optimizer)
        for fqn, entries in optim["state"].items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIMIZER}{fqn}.{name}"] = value
                else:
                    meta["state"].setdefault(fqn, {})[name] = check_json(value, where=f"optimizer state {fqn}.{name}")
    meta["param_groups"] = _groups_by_name(model, optimizer)
    Path(directory).mkdir(parents=True, exist_ok=True)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))
    return meta


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                 meta: Mapping[str, Any]) -> None:
    """Load what :func:`save_sharded` wrote into ``model`` and ``optimizer``, built as the
    saved ones (same parameter names, same optimizer class and groups) under any layout;
    every rank calls it together. Each rank reads the regions of the saved chunks its
    own shards cover.

    Raises CheckpointError naming the checkpoint when a parameter or optimizer entry is
    missing from it, or when shapes differ from the model's."""
    where = str(directory)
    refuse_lora(model, where)
    _check_format(meta, where)
    saved = stored_shapes(directory)
    model_sd = get_model_state_dict(model)
    target = _model_target(model_sd, saved, meta.get("tied", {}), where)
    _check_against(saved, target, where, "weights")
    optim_sd = None
    if meta["stepped"]:
        optim_sd = get_optimizer_state_dict(model, optimizer)
        optim_target = {_stored_name(saved, meta.get("tied", {}), fqn, name): v
                        for fqn, entries in optim_sd["state"].items()
                        for name, v in entries.items() if isinstance(v, torch.Tensor)}
        _check_against(saved, optim_target, where, "optimizer state")
        target.update(optim_target)
    _load(target, directory, no_dist=not _in_group())
    set_model_state_dict(model, model_sd)  # loaded in place above; the API's own checks
    if optim_sd is not None:
        _set_optimizer(model, optimizer, optim_sd, target, meta)
    else:
        optimizer.state.clear()
    _restore_groups(model, optimizer, meta, where)


def read_full(directory: Path, *, prefix: str = MODEL) -> dict[str, torch.Tensor]:
    """The full tensors under ``prefix`` (``model.``: the weights, names without the
    prefix) of a sharded checkpoint, read in this process alone (no process group, DCP's
    ``no_dist``): a full-size tensor is allocated for each and every saved chunk copied in.
    What ``rltune export`` and a one-process look at a checkpoint use."""
    shapes = stored_shapes(directory)
    target = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()
              if name.startswith(prefix)}
    if not target:
        raise CheckpointError(f"{directory}: the sharded checkpoint holds no tensor named {prefix}*")
    _load(target, directory, no_dist=True)
    return {name[len(prefix):]: tensor for name, tensor in target.items()}


def stored_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Full shape and dtype of every tensor the sharded checkpoint in ``directory`` holds,
    from its files' headers (nothing else is read)."""
    return {name: (tuple(md.size), md.properties.dtype) for name, md in _metadata(directory).items()}


def chunk_counts(directory: Path) -> dict[str, int]:
    """How many saved chunks make up each tensor: 1 for one written whole by one rank,
    more for one written in shards."""
    return {name: len(md.chunks) for name, md in _metadata(directory).items()}


def shard_files(directory: Path) -> list[Path]:
    """The per-rank files of a sharded checkpoint, in name order."""
    return sorted(p for p in Path(directory).iterdir() if _SHARD_FILE.fullmatch(p.name))


def _load(target: dict[str, Any], directory: Path, *, no_dist: bool) -> None:
    """``dcp.load`` from the safetensors shards; in one process without the warning DCP
    gives for that (loading in one process is what is meant here)."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=no_dist)


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _metadata(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.is_dir() or not shard_files(directory):
        raise CheckpointError(f"{directory} is not a sharded checkpoint (no shard-*.safetensors files in it)")
    return HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata


def aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{name: earlier name}`` for each entry whose tensor is an earlier entry's (a tied
    LM head and embedding): written once, under the earlier name (safetensors refuses two
    names for one storage, and one copy is all there is)."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and key in first:
            tied[name] = first[key]
        else:
            first.setdefault(key, name)
    return tied


def _model_target(model_sd: Mapping[str, torch.Tensor], saved: Mapping[str, tuple], tied: Mapping[str, str],
                  where: str) -> dict[str, torch.Tensor]:
    """The DCP names to read into each live weight: its own, or, for a name the saving
    model tied to another (written once, under that one), the other's. Names this model
    ties are filled through the tensor they share."""
    target: dict[str, torch.Tensor] = {}
    own = aliases(model_sd)
    for name, tensor in model_sd.items():
        if name in own:
            continue
        key = MODEL + name
        if key not in saved and name in tied:
            key = MODEL + tied[name]
        if key in target:
            raise CheckpointError(f"{where}: {name} and another weight of this model both read {key}, which the "
                                  "saving model tied; load into a model that ties them as well")
        target[key] = tensor
    return target


def _groups_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups as JSON, each parameter by its name in ``model``."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        plain = {k: v for k, v in group.items() if k != "params"}
        plain = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in plain.items()}
        plain["params"] = [name_of[id(p)] for p in group["params"]]
        groups.append(check_json(plain, where=f"optimizer param_groups[{index}]"))
    return groups


def _check_format(meta: Mapping[str, Any], where: str) -> None:
    if meta.get("format") != FORMAT or not {"stepped", "param_groups", "state"} <= set(meta):
        raise CheckpointError(f"{where}: the optimizer meta is not that of a sharded ({FORMAT}) checkpoint")


def _check_against(saved: Mapping[str, tuple], live: Mapping[str, torch.Tensor], where: str, what: str) -> None:
    """Every live entry must be saved with its full shape (a DTensor's ``shape`` is the
    full one)."""
    missing = sorted(set(live) - set(saved))
    if missing:
        raise CheckpointError(
            f"{where}: the sharded checkpoint lacks {len(missing)} {what} entr(ies) of this model, e.g. "
            f"{missing[:3]}; resume with the model (and `model.lora`) of the run that saved it"
        )
    for name, tensor in live.items():
        shape, dtype = saved[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(
                f"{where}: {name} is saved as {dtype} {shape} but this model has {tensor.dtype} "
                f"{tuple(tensor.shape)}; set `model.dtype` as in the run that saved it"
            )


def _stored_name(saved: Mapping[str, Any], tied: Mapping[str, str], fqn: str, name: str) -> str:
    """The DCP name of parameter ``fqn``'s optimizer entry ``name``: its own, or that of
    the parameter the saving model tied it to (a pipeline's last stage holds its own copy
    of a tied head, whose state was saved under the embedding's name)."""
    key = f"{OPTIMIZER}{fqn}.{name}"
    if key not in saved and fqn in tied:
        return f"{OPTIMIZER}{tied[fqn]}.{name}"
    return key


def _set_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict,
                   target: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """The loaded tensors (and the JSON entries) back into ``optimizer`` by name."""
    state = {}
    saved_names = {name: None for name in target}
    for fqn, entries in optim_sd["state"].items():
        state[fqn] = {name: target[_stored_name(saved_names, meta.get("tied", {}), fqn, name)]
                      if isinstance(v, torch.Tensor) else v for name, v in entries.items()}
        state[fqn].update(meta["state"].get(fqn, {}))
    loaded = {"state": state, "param_groups": optim_sd["param_groups"]}
    set_optimizer_state_dict(model, optimizer, loaded, options=StateDictOptions(strict=True))


def _restore_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: Mapping[str, Any],
                    where: str) -> None:
    """The saved hyperparameters (learning rate, betas, ...) into the live groups, which
    must hold the same parameters; tuples kept as the live ones are (JSON has lists)."""
    names, tied = _groups_by_name(model, optimizer), meta.get("tied", {})
    saved_groups = [set(g["params"]) for g in meta["param_groups"]]
    # a pipeline stage holds some of the saved parameters; a tied copy is saved as its twin
    if len(names) != len(saved_groups) or any(
            not all(n in saved or tied.get(n) in saved for n in live["params"])
            for live, saved in zip(names, saved_groups)):
        raise CheckpointError(f"{where}: the optimizer's parameter groups hold other parameters than the "
                              f"saved ones ({len(saved_groups)} group(s)); build the optimizer as the saving run did")
    for live, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for key, value in saved.items():
            if key == "params":
                continue
            current = live.get(key)
            if isinstance(current, tuple):
                value = tuple(value)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                live[key] = value


__all__ = [
    "FORMAT",
    "aliases",
    "chunk_counts",
    "load_sharded",
    "read_full",
    "refuse_lora",
    "save_sharded",
    "shard_files",
    "stored_shapes",
    "writes_shards",
]
