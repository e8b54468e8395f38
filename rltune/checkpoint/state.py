"""Turn live training objects into ``(tensors, meta)`` for the checkpoint store, and back.

``tensors`` is a flat ``dict[str, Tensor]`` (one safetensors file); ``meta`` is JSON-able
(part of ``state.json``). The tensors returned by ``*_to_state`` alias the live objects'
own storage: save them before the next training step.

Restoring needs live objects built the same way as the saved ones (same parameters in
the same order, same optimizer class and groups, same scheduler constructor and
functions). Build the optimizer *and* the scheduler first, then restore both: a
scheduler's constructor writes the learning rate into the optimizer, so restoring the
optimizer before building the scheduler would lose the saved learning rate.

Exact resume (bitwise on CPU fp32) needs, besides the model: ``optimizer_to_state``,
``scheduler_to_state``, ``rng_to_state`` (with every ``torch.Generator`` that draws data
order or noise passed by name), the data position and the step, all from one moment.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

import torch

from rltune.checkpoint.store import CheckpointError, check_json

try:  # numpy is optional for rltune; its global RNG is saved whenever it is importable
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch setup
    np = None


# --------------------------------------------------------------------------- optimizer


def optimizer_to_state(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten ``opt.state_dict()``.

    Tensor entries become ``state.<param_idx>.<name>`` (e.g. AdamW's ``exp_avg``,
    ``exp_avg_sq`` and its tensor ``step``) or ``param_groups.<group_idx>.<key>`` (a
    tensor learning rate); everything else (``param_groups`` with their ``params``
    index lists, non-tensor per-parameter values) goes to ``meta``.
    """
    saved = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state_meta: dict[str, dict[str, Any]] = {}
    for idx, per_param in saved["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value
            else:
                where = f"optimizer state[{idx}][{name!r}]"
                state_meta.setdefault(str(idx), {})[name] = check_json(value, where=where)
    groups: list[dict[str, Any]] = []
    for g_idx, group in enumerate(saved["param_groups"]):
        plain: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"param_groups.{g_idx}.{key}"] = value
            else:
                plain[key] = check_json(value, where=f"optimizer param_groups[{g_idx}][{key!r}]")
        groups.append(plain)
    return tensors, {"state": state_meta, "param_groups": groups}


def optimizer_from_state(
    opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> None:
    """Load what ``optimizer_to_state`` produced into ``opt`` (built like the saved one).

    Tensors are moved to their parameter's device and dtype by ``load_state_dict``.
    """
    state_meta, groups_meta = _require(meta, ("state", "param_groups"), where="optimizer meta")
    state: dict[int, dict[str, Any]] = {int(idx): dict(values) for idx, values in state_meta.items()}
    live_groups = opt.state_dict()["param_groups"]
    if len(groups_meta) != len(live_groups):
        raise CheckpointError(
            f"optimizer meta has {len(groups_meta)} param groups but the optimizer has {len(live_groups)}"
        )
    for index, (saved, live) in enumerate(zip(groups_meta, live_groups)):
        _check_group_types(saved, live, index)
    groups = [shaped_like(saved, live) for saved, live in zip(groups_meta, live_groups)]
    for key, tensor in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or parts[0] not in ("state", "param_groups"):
            raise CheckpointError(f"optimizer tensor key {key!r} is not state.<i>.<name> or param_groups.<i>.<key>")
        kind, idx, name = parts[0], int(parts[1]), parts[2]
        if kind == "state":
            state.setdefault(idx, {})[name] = tensor
        elif idx < len(groups):
            groups[idx][name] = tensor
        else:
            raise CheckpointError(f"optimizer tensor {key!r} names group {idx}, but there are {len(groups)}")
    opt.load_state_dict({"state": state, "param_groups": groups})


def _check_group_types(saved: Any, live: Mapping[str, Any], index: int) -> None:
    """A saved param group's hyper-parameters are of the kind the live group's are (a
    number where it has a number, true/false/null where it has a flag), so that a
    checkpoint edited or written wrong fails here, not in the first optimizer step."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"optimizer meta param_groups[{index}] is {saved!r}, not an object")
    for key, value in saved.items():
        if key == "params" or key not in live:
            continue
        want = live[key]
        if want is None or isinstance(want, bool):
            fits = value is None or isinstance(value, bool)
        elif isinstance(want, (int, float)):
            fits = _is_number(value)
        elif isinstance(want, (list, tuple)):
            fits = isinstance(value, (list, tuple)) and len(value) == len(want) and all(
                _is_number(v) for v, w in zip(value, want) if _is_number(w))
        else:
            continue
        if not fits:
            raise CheckpointError(
                f"optimizer meta param_groups[{index}][{key!r}] is {value!r}, where the optimizer has {want!r}"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------- LR schedule


def scheduler_to_state(sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The scheduler's ``state_dict()``, checked to be JSON-able.

    ``LambdaLR``/``MultiplicativeLR`` keep plain functions and lambdas out of their
    state (they save ``None`` for them, and only the ``__dict__`` of callable objects):
    the scheduler that loads this must be constructed with the same functions.
    """
    return check_json(sched.state_dict(), where=f"{type(sched).__name__}.state_dict()")


def scheduler_from_state(sched: torch.optim.lr_scheduler.LRScheduler, meta: Mapping[str, Any]) -> None:
    """Load a ``scheduler_to_state`` dict (after its JSON round trip) into ``sched``.

    JSON turns tuples into lists and int dict keys into strings (``MultiStepLR``'s
    ``milestones`` is a ``Counter`` keyed by int step); both are undone using the live
    scheduler's own state as the template.
    """
    sched.load_state_dict(shaped_like(meta, sched.state_dict()))


def shaped_like(saved: Any, live: Any) -> Any:
    """Undo JSON's changes to ``saved`` using ``live`` (the same structure, fresh) as template.

    Lists become tuples where ``live`` has a tuple; dict keys become ints where every key
    of ``live`` is an int; dict subclasses (``Counter``) keep ``live``'s type. Entries
    missing from ``live`` are returned as saved.
    """
    if isinstance(live, (list, tuple)) and isinstance(saved, list):
        if len(saved) == len(live):
            items = [shaped_like(s, t) for s, t in zip(saved, live)]
        else:
            items = list(saved)
        return tuple(items) if isinstance(live, tuple) else items
    if isinstance(live, dict) and isinstance(saved, Mapping):
        int_keys = bool(live) and all(isinstance(k, int) and not isinstance(k, bool) for k in live)
        out = copy.copy(live)
        out.clear()
        for key, value in saved.items():
            key = int(key) if int_keys else key
            out[key] = shaped_like(value, live[key]) if key in live else value
        return out
    return saved


# --------------------------------------------------------------------------- RNG


def rng_to_state(
    generators: Mapping[str, torch.Generator] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Capture every random number generator a training step can draw from.

    Sources: Python ``random`` (JSON), numpy's global legacy RNG when numpy is importable
    (``numpy.keys`` tensor + JSON), torch's CPU RNG (``torch.cpu``), the CUDA RNG of every
    visible device (``torch.cuda.<i>``), and each extra ``torch.Generator`` by name
    (``generator.<name>``), e.g. the one that shuffles the data.
    """
    generators = dict(generators or {})
    version, internal, gauss_next = random.getstate()
    tensors = {"torch.cpu": torch.get_rng_state()}
    meta: dict[str, Any] = {"python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if np is not None:
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        tensors["numpy.keys"] = torch.from_numpy(keys.astype(np.int64))
        meta["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for device, cuda_state in enumerate(cuda_states):
        tensors[f"torch.cuda.{device}"] = cuda_state
    meta["cuda_devices"] = len(cuda_states)
    for name, gen in generators.items():
        tensors[f"generator.{name}"] = gen.get_state()
    meta["generators"] = sorted(generators)
    return tensors, meta


def rng_from_state(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    generators: Mapping[str, torch.Generator] | None = None,
) -> None:
    """Restore what ``rng_to_state`` captured; ``generators`` must have the same names.

    Raises CheckpointError when the sources differ from the saved ones (numpy present in
    one and not the other, another number of CUDA devices, other generator names): the
    run could not continue exactly, so nothing is restored.
    """
    generators = dict(generators or {})
    _check_rng_sources(tensors, meta, generators)
    py = meta["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if np is not None:
        nps = meta["numpy"]
        keys = tensors["numpy.keys"].numpy().astype(np.uint32)
        np.random.set_state((nps["kind"], keys, nps["pos"], nps["has_gauss"], nps["cached_gaussian"]))
    torch.set_rng_state(tensors["torch.cpu"])
    if meta["cuda_devices"]:
        torch.cuda.set_rng_state_all([tensors[f"torch.cuda.{d}"] for d in range(meta["cuda_devices"])])
    for name, gen in generators.items():
        gen.set_state(tensors[f"generator.{name}"])


def _check_rng_sources(tensors: Mapping, meta: Mapping, generators: Mapping[str, torch.Generator]) -> None:
    _require(meta, ("python", "cuda_devices", "generators"), where="rng meta")
    if (np is not None) != ("numpy" in meta):
        have = "is" if np is not None else "is not"
        raise CheckpointError(
            f"numpy {have} importable here, but the checkpoint {'lacks' if np is not None else 'holds'} "
            "numpy's RNG state; resume in an environment that matches the one that saved"
        )
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if meta["cuda_devices"] != visible:
        raise CheckpointError(
            f"the checkpoint holds CUDA RNG states for {meta['cuda_devices']} device(s) but {visible} "
            "are visible; resume with the same CUDA_VISIBLE_DEVICES as the run that saved"
        )
    if sorted(generators) != list(meta["generators"]):
        raise CheckpointError(
            f"the checkpoint holds generators {list(meta['generators'])} but {sorted(generators)} were passed"
        )
    expected = {"torch.cpu", *(f"torch.cuda.{d}" for d in range(visible))}
    expected |= {f"generator.{name}" for name in generators}
    expected |= {"numpy.keys"} if np is not None else set()
    if set(tensors) != expected:
        raise CheckpointError(
            f"rng tensors {sorted(tensors)} do not match the saved sources {sorted(expected)}"
        )


def _require(meta: Mapping[str, Any], keys: tuple[str, ...], *, where: str) -> list[Any]:
    missing = [key for key in keys if key not in meta]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}; it was not written by this module")
    return [meta[key] for key in keys]
