"""Starting or joining Ray, and placing the run's actors from ``runtime.placement``."""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltune.config.runtime import PlacementConfig, RoleResources, RuntimeConfig

if TYPE_CHECKING:
    import torch

ROLES = ("learner", "generator", "scorer")
MODEL_ROLES = ("reference", "critic")
"""Roles a run has when its algorithm needs them (``extra`` of :func:`place`); each
reserves what a learner reserves (``runtime.placement.learner``)."""
PLACEMENT_TIMEOUT_S = 120.0


class RayRuntimeError(RuntimeError):
    """The cluster cannot run the run as configured (shown to the user without a traceback)."""


def record_fault(path: Path, **fields: Any) -> None:
    """Append one event (a replaced actor, a resumed run) to ``RUN/faults.jsonl``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"time": time.time(), **fields}) + "\n")


def death_reason(err: BaseException) -> str:
    """The last line of Ray's message for a dead actor: the exception that killed it (its
    creation failed) or how it died (killed, its process or node lost)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def raised_in_actor(err: BaseException) -> BaseException:
    """The error an actor raised, for Ray's ``RayTaskError(ErrorType)`` that carries it to
    the driver (its text is the actor's traceback); any other error as it is."""
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, BaseException):
        return err.cause
    return err


def refusals() -> tuple[type[Exception], ...]:
    """The errors with which an actor's construction refuses its input or its machine (a
    config or layout it cannot run, a model, reward, environment or data it cannot load,
    a precision or memory setting its device lacks). Another actor of the same config on
    the same machine would refuse again, so none is restarted for them."""
    from rltune.checkpoint.store import CheckpointError
    from rltune.config import ConfigError
    from rltune.data.loaders import DataError
    from rltune.envs.loading import EnvLoadError
    from rltune.learner.memory import MemorySettingError
    from rltune.learner.precision import PrecisionError
    from rltune.models.load import ModelLoadError
    from rltune.models.routing import RoutingError
    from rltune.models.safetensors_io import TensorFileError
    from rltune.parallel.layout import LayoutError
    from rltune.rewards.loading import RewardLoadError

    return (ConfigError, DataError, ModelLoadError, RewardLoadError, CheckpointError, EnvLoadError, TensorFileError,
            LayoutError, PrecisionError, MemorySettingError, RoutingError)


def refuses_at_start(cls: type) -> type:
    """``cls`` (an actor class) whose construction, when it raises one of
    :func:`refusals`, does not kill the actor: the actor keeps the error and every method
    call raises it. The driver's call then gets the user's error itself (Ray's
    ``RayTaskError`` of its type: one line at the command line, exit 2), where an actor
    dead in its creation task is an ``ActorDiedError`` that the driver restarts (up to
    ``runtime.actor_restarts`` or ``runtime.learner_restarts``) to the same refusal. A
    replacement's refusal still counts as a death (``ActorPool.fresh``, and the run's
    resume in ``run.py``): it may see what the actor it replaces still held."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except refusals() as err:
            self._refused = err.with_traceback(None)  # its frames would keep what __init__ built alive

    cls.__init__ = __init__
    for name, method in list(vars(cls).items()):
        if inspect.isfunction(method) and not name.startswith("_"):
            setattr(cls, name, _raising_refusal(method))
    return cls


def _raising_refusal(method: Any) -> Any:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        refused = self.__dict__.get("_refused")
        if refused is not None:
            raise refused.with_traceback(None)  # each raise would otherwise lengthen the last one's
        return method(self, *args, **kwargs)
    return call


def actor_setup(threads: int) -> None:
    """What every actor does first: ``threads`` torch threads (its CPU reservation), and no
    per-load progress bars from transformers in the driver's log."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(max(1, threads))
    hf_logging.disable_progress_bar()


def actor_device() -> torch.device:
    """Where this actor's model computes: its GPU when Ray gave it one (Ray sets
    ``CUDA_VISIBLE_DEVICES`` to it, so it is device 0 here), else the CPU."""
    import torch

    if ray.get_gpu_ids() and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def connect(runtime: RuntimeConfig, extra: tuple[str, ...] = ()) -> bool:
    """Join ``runtime.ray_address``, or start a local Ray bound to 127.0.0.1 with enough
    logical CPUs for the placement. Returns whether this call started Ray (and so should
    stop it). A Ray already initialised in this process is used as it is."""
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if runtime.ray_address is not None:
        try:
            ray.init(address=runtime.ray_address, runtime_env=env, log_to_driver=True)
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise RayRuntimeError(f"runtime.ray_address={runtime.ray_address!r}: cannot join the cluster: {err}") from None
        return False
    need = total(runtime.placement, extra)
    _check_local_gpus(need["GPU"])
    cores = os.cpu_count() or 1
    if need["CPU"] > cores:
        # Ray's CPUs are reservations: a local Ray with fewer would never place the actors
        print(f"rltune: runtime.placement reserves {need['CPU']:g} CPUs and this machine has {cores}; "
              "the local Ray shares the cores between the actors", flush=True)
    ray.init(
        num_cpus=max(os.cpu_count() or 1, int(-(-need["CPU"] // 1))),
        num_gpus=int(-(-need["GPU"] // 1)) or None,
        include_dashboard=False,
        runtime_env=env,
        log_to_driver=True,
    )
    return True


def _check_local_gpus(need: float) -> None:
    """Refuse a placement that reserves more GPUs than this machine has, for a Ray started
    here: Ray would advertise GPUs that do not exist, and the actors given them would find
    no CUDA device and run on the CPU, silently."""
    if not need:
        return
    import torch

    have = torch.cuda.device_count()
    if need > have:
        raise RayRuntimeError(
            f"runtime.placement reserves {need:g} GPUs and this machine has {have}"
            f"{' (torch sees no CUDA device)' if have == 0 else ''}; set the roles' gpus "
            f"(runtime.placement.*.gpus) to fit, or join a cluster that has them (runtime.ray_address)"
        )


def total(placement: PlacementConfig, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """The logical CPUs and GPUs the placement reserves in all."""
    bundles = bundle_specs(placement, extra)[0]
    return {
        "CPU": sum(b.get("CPU", 0.0) for b in bundles),
        "GPU": sum(b.get("GPU", 0.0) for b in bundles),
    }


def _resources(r: RoleResources) -> dict[str, float]:
    out = {"CPU": float(r.cpus)}
    if r.gpus:
        out["GPU"] = float(r.gpus)
    return out


def bundle_specs(
    placement: PlacementConfig, extra: tuple[str, ...] = ()
) -> tuple[list[dict[str, float]], dict[str, list[int]]]:
    """The placement group's bundles, and for each role the bundle index of each of its
    actors. Learners come first; with ``colocate`` generator ``i`` shares learner ``i``'s
    bundle (which then holds both roles' resources). ``extra``: one bundle for each of
    these :data:`MODEL_ROLES`, last."""
    bundles: list[dict[str, float]] = []
    index: dict[str, list[int]] = {role: [] for role in (*ROLES, *extra)}
    for _ in range(placement.learners):
        index["learner"].append(len(bundles))
        bundles.append(_resources(placement.learner))
    for i in range(placement.generators):
        gen = _resources(placement.generator)
        if placement.colocate:
            shared = bundles[index["learner"][i]]
            for key, value in gen.items():
                shared[key] = shared.get(key, 0.0) + value
            index["generator"].append(index["learner"][i])
        else:
            index["generator"].append(len(bundles))
            bundles.append(gen)
    for _ in range(placement.scorers):
        index["scorer"].append(len(bundles))
        bundles.append(_resources(placement.scorer))
    for role in extra:
        if role not in MODEL_ROLES:
            raise ValueError(f"unknown placement role {role!r}; known: {', '.join(MODEL_ROLES)}")
        index[role].append(len(bundles))
        bundles.append(_resources(placement.learner))
    return bundles, index


@dataclass
class Placement:
    """The run's placement group and where each actor of each role goes."""

    group: PlacementGroup
    index: dict[str, list[int]]
    placement: PlacementConfig

    def options(self, role: str, i: int) -> dict[str, Any]:
        """``ActorClass.options(**...)`` for actor ``i`` of ``role``: its bundle and its
        share of the bundle's resources."""
        r = self.resources(role)
        opts: dict[str, Any] = {
            "num_cpus": r.cpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.index[role][i]
            ),
        }
        if r.gpus:
            opts["num_gpus"] = r.gpus
        return opts

    def resources(self, role: str) -> RoleResources:
        """What an actor of ``role`` reserves (the model roles: a learner's share)."""
        return self.placement.learner if role in MODEL_ROLES else getattr(self.placement, role)

    def threads(self, role: str) -> int:
        """Torch threads for an actor of ``role``: its CPUs, at least one."""
        return max(1, int(self.resources(role).cpus))

    def remove(self) -> None:
        remove_placement_group(self.group)


def place(placement: PlacementConfig, *, name: str = "", extra: tuple[str, ...] = ()) -> Placement:
    """Reserve the bundles of ``placement`` (and one for each role of ``extra``); a
    RayRuntimeError names what the cluster lacks when they cannot be placed within
    PLACEMENT_TIMEOUT_S."""
    bundles, index = bundle_specs(placement, extra)
    group = placement_group(bundles, strategy=placement.strategy, name=name)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        have = ray.cluster_resources()
        raise RayRuntimeError(
            f"runtime.placement needs {total(placement, extra)} in bundles {bundles} "
            f"(strategy {placement.strategy}); the cluster has "
            f"CPU={have.get('CPU', 0)}, GPU={have.get('GPU', 0)} and could not place them in "
            f"{PLACEMENT_TIMEOUT_S:.0f} s"
        ) from None
    return Placement(group, index, placement)
