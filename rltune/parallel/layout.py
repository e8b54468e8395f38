"""The learner group's layout: how many ranks each kind of parallelism takes, resolved
from ``train.parallel`` and the group's size, and checked against the model's config
before any weight is loaded.

The group is one DeviceMesh of five named dims, always all present (size 1 allowed), in
the order :data:`MESH_DIMS` (``pp, dp_replicate, dp_shard, ep, tp``); the world size is
their product. Ranks along ``dp_replicate``, ``dp_shard`` and ``ep`` train on different
rows; ranks along ``tp`` and ``pp`` see the same rows (``rltune/parallel/mesh.py``).

Back-compatibility: a config that sets nothing under ``train.parallel`` keeps the
meaning of ``runtime.placement.learner_strategy``: ``ddp`` is ``dp_replicate = world``,
``fsdp2`` is ``dp_shard = world`` (:func:`layout_for`). As soon as one key of
``train.parallel`` is set, the layout is ``train.parallel``'s and ``learner_strategy``
is not read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod
from typing import Any

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "ep", "tp")
"""The learner mesh's dims, outermost first (the contract every parallel module shares)."""
DATA_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "ep")
"""The dims whose ranks train on different rows (the data rank is their flattened index)."""

_WORLD_SOURCE = "runtime.placement.learners on Ray; WORLD_SIZE or 1 process locally"
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class LayoutError(ValueError):
    """The learner group's layout cannot train this model on this many ranks; the message
    names each problem, the keys and numbers involved, and the fix."""


@dataclass(frozen=True)
class Layout:
    """How many ranks each dim of the learner mesh takes (all >= 1)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = False

    @property
    def world(self) -> int:
        """Ranks in the group: the product of every degree."""
        return prod(self.shape)

    @property
    def data_world(self) -> int:
        """Ranks that train on different rows: ``dp_replicate * dp_shard * ep``."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, in :data:`MESH_DIMS` order."""
        return tuple(getattr(self, dim) for dim in MESH_DIMS)

    def describe(self) -> str:
        """``pp=1 dp_replicate=2 ...``: the degrees, for messages."""
        return " ".join(f"{dim}={getattr(self, dim)}" for dim in MESH_DIMS)


def resolve_layout(parallel_cfg: Any, world: int) -> Layout:
    """The :class:`Layout` of ``parallel_cfg`` (a ``train.parallel`` section) on ``world``
    ranks. ``dp_shard: auto`` takes what the other degrees leave, which must divide the
    world exactly; an explicit ``dp_shard`` is taken as is (:func:`layout_problems` then
    says whether the product is the world)."""
    others = parallel_cfg.dp_replicate * parallel_cfg.tp * parallel_cfg.pp * parallel_cfg.ep
    dp_shard = parallel_cfg.dp_shard
    if dp_shard == "auto":
        if world % others:
            raise LayoutError(
                f"train.parallel.dp_shard=auto: the world of {world} learner rank(s) is not a multiple of "
                f"dp_replicate*tp*pp*ep = {parallel_cfg.dp_replicate}*{parallel_cfg.tp}*{parallel_cfg.pp}*"
                f"{parallel_cfg.ep} = {others}; make the learner count a multiple of {others} or lower those degrees"
            )
        dp_shard = world // others
    return Layout(
        dp_replicate=parallel_cfg.dp_replicate, dp_shard=int(dp_shard), ep=parallel_cfg.ep,
        tp=parallel_cfg.tp, pp=parallel_cfg.pp, pp_schedule=parallel_cfg.pp_schedule,
        sequence_parallel=parallel_cfg.sequence_parallel,
    )


def layout_for(cfg: Any, world: int) -> Layout:
    """The layout of a run config ``cfg`` on ``world`` ranks, with the back-compatibility
    rule of the module docstring (nothing set under ``train.parallel``: the layout that
    ``runtime.placement.learner_strategy`` has always meant)."""
    parallel = cfg.train.parallel
    if not parallel.model_fields_set:
        if cfg.runtime.placement.learner_strategy == "fsdp2":
            return Layout(dp_shard=world)
        return Layout(dp_replicate=world)
    return resolve_layout(parallel, world)


def layout_problems(layout: Layout, world: int, model_config: Any) -> list[str]:
    """Every reason ``layout`` cannot train the model of ``model_config`` (its Hugging Face
    config, or None to check only the degrees) on ``world`` ranks, one line each, naming
    the keys, the numbers and the fix; empty when it can."""
    problems = []
    if layout.world != world:
        problems.append(
            f"train.parallel: pp*dp_replicate*dp_shard*ep*tp = {'*'.join(map(str, layout.shape))} = {layout.world} "
            f"ranks, but the learner group has {world} ({_WORLD_SOURCE}); make the product {world} "
            "(dp_shard: auto takes what the others leave)"
        )
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("train.parallel.sequence_parallel=true needs tp > 1 (it shards the tensor-parallel "
                        "regions' activations over the sequence); set tp or sequence_parallel=false")
    if model_config is not None:
        problems += _model_problems(layout, model_config)
    return problems


def _model_problems(layout: Layout, config: Any) -> list[str]:
    """The problems of ``layout`` that come from the model's shapes (a vision-language
    model's are its language model's: the learner's layout splits that)."""
    problems = []
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(config, "model_type", "the model")
    counts = {key: getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads", "vocab_size")}
    counts = {key: int(n) for key, n in counts.items() if n is not None}
    uneven = {key: n for key, n in counts.items() if n % layout.tp}
    if uneven:
        common = [d for d in _divisors(min(counts.values())) if all(n % d == 0 for n in counts.values())]
        problems.append(
            f"train.parallel.tp={layout.tp} does not divide {name}'s "
            f"{', '.join(f'{key}={n}' for key, n in uneven.items())} (tensor parallelism splits the heads "
            f"and the vocabulary evenly); choose tp among {common}"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layout.pp > layers:
        problems.append(f"train.parallel.pp={layout.pp} stages, but {name} has {layers} layers (each stage needs "
                        f"at least one); set pp <= {layers}")
    experts = expert_count(config)
    if layout.ep > 1 and experts <= 1:
        problems.append(f"train.parallel.ep={layout.ep}, but {name} is dense (no experts to split); set ep=1")
    elif layout.ep > 1 and experts % layout.ep:
        problems.append(f"train.parallel.ep={layout.ep} does not divide {name}'s {experts} experts; choose ep "
                        f"among {_divisors(experts)}")
    return problems


def expert_count(config: Any) -> int:
    """How many routed experts a model's config names (0 for a dense model)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max(int(getattr(config, key, None) or 0) for key in _EXPERT_COUNT_KEYS)


def check_layout(layout: Layout, world: int, model_config: Any) -> Layout:
    """``layout``, or a :class:`LayoutError` listing :func:`layout_problems`."""
    problems = layout_problems(layout, world, model_config)
    if problems:
        raise LayoutError(f"the learner layout ({layout.describe()}) cannot run: " + "; ".join(problems))
    return layout


def run_world(cfg: Any) -> int:
    """The learner group's size for a run config: ``runtime.placement.learners`` on Ray;
    locally the ``WORLD_SIZE`` torchrun sets, else 1."""
    if cfg.runtime.mode == "ray":
        return cfg.runtime.placement.learners
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise LayoutError(f"environment variable WORLD_SIZE={value!r} is not an integer") from None


def model_config_of(model_path: str, *, trust_remote_code: bool = False) -> Any:
    """The Hugging Face config of ``model_path`` without its weights: ``builtin:NAME``
    from its build spec, a directory from its ``config.json``."""
    from rltune.models.load import BUILTIN_PREFIX, ModelLoadError, _existing_dir, _read_config

    if model_path.startswith(BUILTIN_PREFIX):
        from rltune.models.tiny import ARCH_CONFIGS, SPECIAL_TOKENS, TINY_SPECS
        from rltune.models.tiny_vl import TINY_VL_SPECS, tiny_vl_config

        name = model_path[len(BUILTIN_PREFIX):]
        if name in TINY_VL_SPECS:
            return tiny_vl_config(**TINY_VL_SPECS[name])
        if name not in TINY_SPECS:
            known = ", ".join(BUILTIN_PREFIX + n for n in (*TINY_SPECS, *TINY_VL_SPECS))
            raise ModelLoadError(f"unknown builtin model {model_path!r}; set `model.path` to one of {known}")
        spec = dict(TINY_SPECS[name])
        # the byte-level tokenizer of rltune.models.tiny: its special tokens, then 256 bytes
        return ARCH_CONFIGS[spec.pop("arch")](vocab_size=len(SPECIAL_TOKENS) + 256, **spec)
    from transformers import AutoConfig

    directory = _existing_dir(model_path)
    _read_config(directory)  # the loader's own errors for a missing or damaged config.json
    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the config of {directory}: {err}") from None


def run_layout(cfg: Any) -> Layout:
    """The checked layout of a run config, before any model is loaded: the world of
    :func:`run_world`, :func:`layout_for`, and the model's shapes from its config alone.
    Raises :class:`LayoutError` naming every problem; also for a local run started as
    several processes (torchrun), which the local runtime cannot make one group of."""
    world = run_world(cfg)
    layout = layout_for(cfg, world)
    if cfg.runtime.mode != "ray" and world > 1:
        # the local runtime trains in this one process: it would not join the group
        raise LayoutError(
            f"WORLD_SIZE={world}: runtime.mode=local trains the learner in one process and forms no learner "
            f"group, so {world} processes would train {world} separate copies; run one process, or set "
            f"runtime.mode=ray with runtime.placement.learners={world}"
        )
    if layout.tp == layout.pp == layout.ep == 1:  # nothing to check against the model's shapes
        return check_layout(layout, world, None)
    trust = bool(getattr(cfg.model, "trust_remote_code", False))
    return check_layout(layout, world, model_config_of(cfg.model.path, trust_remote_code=trust))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = [
    "DATA_DIMS",
    "MESH_DIMS",
    "Layout",
    "LayoutError",
    "check_layout",
    "expert_count",
    "layout_for",
    "layout_problems",
    "model_config_of",
    "resolve_layout",
    "run_layout",
    "run_world",
]
