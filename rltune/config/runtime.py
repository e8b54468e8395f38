"""The ``runtime`` config section: where the roles run (this process, or Ray actors placed
by ``placement``) and how they exchange weights and rewards."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no setting is infinite or NaN


class RoleResources(_Section):
    """What one actor of a role reserves on a Ray cluster (logical resources)."""

    cpus: float = Field(1.0, ge=0)
    """CPUs reserved; the actor's torch uses this many threads (at least one)."""
    gpus: float = Field(0.0, ge=0)
    """GPUs reserved (fractions share a GPU); Ray sets the actor's CUDA_VISIBLE_DEVICES."""


class PlacementConfig(_Section):
    """How many actors of each role ``runtime.mode: ray`` starts, and what each reserves.
    All of them are placed through one Ray placement group of one bundle per actor."""

    generators: int = Field(1, ge=1)
    """Generator actors; a step's prompts are split between them."""
    scorers: int = Field(1, ge=1)
    """Scorer actors; a step's rollouts are split between them."""
    learners: int = Field(1, ge=1)
    """Learner actors forming one torch.distributed group (gloo on CPU, NCCL on GPU)."""
    learner_strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the learner group holds the model: replicated (DDP) or sharded (FSDP2)."""
    generator: RoleResources = RoleResources()
    scorer: RoleResources = RoleResources()
    learner: RoleResources = RoleResources()
    colocate: bool = False
    """Generator ``i`` shares learner ``i``'s bundle (needs generators <= learners): the
    two reserve one bundle with both roles' resources, e.g. one GPU each pair. False: every
    actor has a bundle of its own."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray's placement-group strategy for the bundles across nodes."""

    @model_validator(mode="after")
    def _check(self) -> "PlacementConfig":
        if self.colocate and self.generators > self.learners:
            raise ValueError(
                f"runtime.placement.colocate puts each generator with a learner; generators "
                f"({self.generators}) must be <= learners ({self.learners})"
            )
        return self


class RuntimeConfig(_Section):
    mode: Literal["local", "ray"] = "local"
    """``local``: everything in this process. ``ray``: generators, scorers and learners as
    Ray actors placed by ``placement`` (needs the ``ray`` extra); the same loop drives both."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where ``runtime.mode: local`` computes (the policy, its generator, the reference and
    the critic): ``auto``: the current CUDA device when torch sees one, else the CPU;
    ``cuda`` fails at start without one. On Ray each actor's device comes from the GPUs
    ``placement`` gives it, so there it must stay ``auto``."""
    ray_address: str | None = None
    """The Ray cluster to join (``auto``, ``ray://host:10001``, ``host:6379``); None starts a
    local one for the run, bound to 127.0.0.1, and stops it at the end."""
    placement: PlacementConfig = PlacementConfig()
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """How new weights reach the generator actors: ``object_store``: learner rank 0 puts
    them into Ray's object store once and every generator reads them; ``broadcast``:
    learner rank 0 and the generators form a process group of their own (NCCL between
    GPUs, gloo on CPU) and each sync is a collective broadcast into the generators' models."""
    actor_restarts: int = Field(3, ge=0)
    """How many times a dead generator or scorer actor is restarted (its in-flight prompts
    reissued) before the run fails."""
    learner_restarts: int = Field(1, ge=0)
    """How many times a run whose learner died resumes from its newest checkpoint by
    itself (``runtime.mode: ray``; needs ``checkpoint.every``)."""
    reward_workers: int = Field(4, ge=1)
    """Reward calls that run at once (threads or processes)."""
    reward_pool: Literal["thread", "process"] = "thread"
    """``process`` for CPU-bound Python rewards: they then run in parallel, and a hung
    call's worker is killed; ``thread`` for rewards that wait (HTTP, the code sandbox)."""
    reward_cache_size: int = Field(100_000, ge=0)
    """Values of identical calls kept across steps (0: no cache)."""
    max_staleness: int = Field(0, ge=0)
    """0: generate, score and learn in turn, always on the newest policy. k > 0: generate
    and score up to k steps ahead of the learner, on a copy of the weights up to k
    versions old (needs ``algo.importance_correction``); see ``rltune/runtime/rollouts.py``."""

    @model_validator(mode="after")
    def _check(self) -> "RuntimeConfig":
        if self.mode == "ray" and self.device != "auto":
            raise ValueError(
                f"runtime.device={self.device} sets the device of runtime.mode: local; on Ray each actor "
                "computes on the GPUs runtime.placement gives it (learner.gpus, generator.gpus): leave "
                "runtime.device at auto"
            )
        return self


RAY_ONLY = ("ray_address", "placement", "weight_sync", "actor_restarts", "learner_restarts")
"""The ``runtime`` keys only ``runtime.mode: ray`` reads: the local runtime starts no Ray,
places no actors and restarts none."""


def ray_keys_set(runtime: RuntimeConfig) -> list[str]:
    """The Ray-only keys (:data:`RAY_ONLY`) of ``runtime`` set away from their defaults, each
    as ``runtime.key=value`` (``runtime.placement.learner.gpus=1.0`` inside placement)."""
    default = RuntimeConfig()
    return [f"runtime.{key}={value}" for name in RAY_ONLY
            for key, value in _changed(name, getattr(runtime, name), getattr(default, name))]


def _changed(key: str, value: object, default: object) -> list[tuple[str, object]]:
    """``(dotted key, value)`` of ``value``'s leaves that differ from ``default``'s."""
    if isinstance(value, BaseModel) and isinstance(default, BaseModel):
        return [pair for name in type(value).model_fields
                for pair in _changed(f"{key}.{name}", getattr(value, name), getattr(default, name))]
    return [] if value == default else [(key, value)]
