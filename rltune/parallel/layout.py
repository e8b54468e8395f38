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
is not read (``fsdp2`` beside it is refused by :func:`run_layout`: it would do nothing).
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

_DEFAULT_SCHEDULE = "1f1b"
_WORLD_SOURCE = "runtime.placement.learners on Ray; WORLD_SIZE or 1 process locally"
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# What pipeline stages cannot do, told before any model loads (:func:`run_layout`) and, as
# a last guard, by ``rltune/parallel/pipeline.py`` where the stages are built and run.
PP_AUX_LOSS = ("train.parallel.pp > 1 does not gather MoE router logits across stages, so it cannot add the "
               "load-balancing loss (coefficient {coef}): set model.router_aux_loss_coef: 0 (or train.parallel.pp: 1)")
PP_ROUTING_REPLAY = ("train.parallel.pp > 1 does not replay recorded MoE routes (the stages' routers are not "
                     "given them): set model.moe.routing_replay: off, or train.parallel.pp: 1")
PP_AUX_FREE_BIAS = ("model.moe.aux_free_bias moves each router's bias by the step's expert load, which "
                    "train.parallel.pp > 1 does not gather across stages: set it to 0, or pp: 1")
PP_SEQUENCE_PARALLEL = ("train.parallel: pp > 1 with tp > 1 sends replicated hidden states between stages; "
                        "sequence_parallel (sequence-sharded ones) is not supported with pp: set it to false")
LORA_LAYOUTS = ("train LoRA on Ray with runtime.placement.learner_strategy: ddp and no train.parallel key, "
                "or in one process (runtime.mode: local)")
"""Where a LoRA model's checkpoint (its adapters and a fingerprint of the frozen base
weights, which only a learner holding the whole model can give) can be written."""


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
    pp_schedule: str = _DEFAULT_SCHEDULE
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
    layout, problem = _resolve(parallel_cfg, world)
    if problem is not None:
        raise LayoutError(problem)
    return layout


def _resolve(parallel_cfg: Any, world: int) -> tuple[Layout, str | None]:
    """:func:`resolve_layout`, with the reason ``dp_shard: auto`` cannot be resolved
    returned (``dp_shard`` is then 1) instead of raised, so that it can be told together
    with the layout's other problems."""
    others = parallel_cfg.dp_replicate * parallel_cfg.tp * parallel_cfg.pp * parallel_cfg.ep
    dp_shard, problem = parallel_cfg.dp_shard, None
    if dp_shard == "auto":
        dp_shard = world // others
        if world % others:
            dp_shard = 1
            problem = (
                f"train.parallel.dp_shard=auto: the world of {world} learner rank(s) is not a multiple of "
                f"dp_replicate*tp*pp*ep = {parallel_cfg.dp_replicate}*{parallel_cfg.tp}*{parallel_cfg.pp}*"
                f"{parallel_cfg.ep} = {others}; make the learner count a multiple of {others} or lower those degrees"
            )
    layout = Layout(
        dp_replicate=parallel_cfg.dp_replicate, dp_shard=int(dp_shard), ep=parallel_cfg.ep,
        tp=parallel_cfg.tp, pp=parallel_cfg.pp, pp_schedule=parallel_cfg.pp_schedule,
        sequence_parallel=parallel_cfg.sequence_parallel,
    )
    return layout, problem


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
    elif layout.sequence_parallel and layout.pp > 1:
        problems.append(PP_SEQUENCE_PARALLEL)
    if layout.pp == 1 and layout.pp_schedule != _DEFAULT_SCHEDULE:
        problems.append(f"train.parallel.pp_schedule={layout.pp_schedule} schedules pipeline stages, but pp=1 "
                        "has none; set pp > 1, or remove pp_schedule")
    if model_config is not None:
        problems += _model_problems(layout, model_config)
    return problems


TP_DENSE = ("llama", "mistral", "qwen2", "qwen3")
TP_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
TP_MODEL_TYPES = TP_DENSE + TP_MOE
"""``config.model_type`` values tensor parallelism has a plan for
(:func:`rltune.parallel.tensor.apply_tensor_parallel`)."""


def tp_widths(config: Any) -> dict[str, int]:
    """The MLP widths tensor parallelism splits besides heads and vocabulary: a dense
    model's ``intermediate_size`` (also an MoE model's with dense layers) and a shared
    expert's."""
    model_type = getattr(config, "model_type", None)
    widths = {}
    if model_type in TP_DENSE or getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) > 1:
        widths["intermediate_size"] = config.intermediate_size
    if getattr(config, "shared_expert_intermediate_size", None):
        widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return widths


def _model_problems(layout: Layout, config: Any) -> list[str]:
    """The problems of ``layout`` that come from the model's shapes (a vision-language
    model's are its language model's: the learner's layout splits that), and tensor
    parallelism on a model it has no plan for (by the model's own ``model_type``: a
    vision-language model's is its own, not its language model's)."""
    problems = []
    top_type = getattr(config, "model_type", None)
    if layout.tp > 1 and top_type not in TP_MODEL_TYPES:
        problems.append(f"train.parallel.tp={layout.tp}: tensor parallelism has no plan for model_type "
                        f"{top_type!r}; supported model types: {', '.join(TP_MODEL_TYPES)}; set tp: 1 for this model")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(config, "model_type", "the model")
    names = ("num_attention_heads", "num_key_value_heads", "vocab_size")
    counts = {key: getattr(config, key, None) for key in names}
    if layout.tp > 1 and top_type in TP_MODEL_TYPES:
        counts |= tp_widths(config)
    counts = {key: int(n) for key, n in counts.items() if n is not None}
    uneven = {key: n for key, n in counts.items() if n % layout.tp}
    if uneven:
        common = [d for d in _divisors(min(counts.values())) if all(n % d == 0 for n in counts.values())]
        problems.append(
            f"train.parallel.tp={layout.tp} does not divide {name}'s "
            f"{', '.join(f'{key}={n}' for key, n in uneven.items())} (tensor parallelism splits the heads, "
            f"the vocabulary and the MLP widths evenly); choose tp among {common}"
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
        world = int(value)
    except ValueError:
        raise LayoutError(f"environment variable WORLD_SIZE={value!r} is not an integer") from None
    if world < 1:
        raise LayoutError(f"environment variable WORLD_SIZE={value!r}: the number of processes must be at least 1; "
                          "unset WORLD_SIZE (one process) or set it to the number of processes started")
    return world


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
    :func:`run_world`, :func:`layout_for`, the model's shapes from its config alone, and
    what the rest of the config asks of the layout (:func:`config_problems`). Raises
    :class:`LayoutError` naming every problem; also for a local run started as several
    processes (torchrun), which the local runtime cannot make one group of."""
    world = run_world(cfg)
    if cfg.runtime.mode != "ray" and world > 1:
        # the local runtime trains in this one process: it would not join the group
        raise LayoutError(
            f"WORLD_SIZE={world}: runtime.mode=local trains the learner in one process and forms no learner "
            f"group, so {world} processes would train {world} separate copies; run one process, or set "
            f"runtime.mode=ray with runtime.placement.learners={world}"
        )
    parallel, local = cfg.train.parallel, cfg.runtime.mode != "ray"
    layout, unresolved = _resolve(parallel, world) if parallel.model_fields_set else (layout_for(cfg, world), None)
    if local and _asked_world(parallel) > 1:  # no group to size: say how to get one
        problems = [_local_problem(parallel)]
    else:
        problems = [] if unresolved is None else [unresolved]
    model_config = None
    if not layout.tp == layout.pp == layout.ep == 1:  # else nothing to check against the model's shapes
        trust = bool(getattr(cfg.model, "trust_remote_code", False))
        model_config = model_config_of(cfg.model.path, trust_remote_code=trust)
    # the product is the world's only where the run has a group of that size and auto resolved
    problems += layout_problems(layout, layout.world if local or unresolved else world, model_config)
    problems += config_problems(cfg, layout, model_config, resolved=unresolved is None)
    if problems:
        degrees = layout.describe()
        if unresolved is not None:  # dp_shard=1 stands in for an auto that did not divide the world
            degrees = degrees.replace("dp_shard=1", "dp_shard=auto")
        raise LayoutError(f"the learner layout ({degrees}) cannot run: " + "; ".join(problems))
    return layout


def _asked_world(parallel: Any) -> int:
    """The ranks ``train.parallel`` asks for at least (``dp_shard: auto`` counted as 1)."""
    shard = 1 if parallel.dp_shard == "auto" else parallel.dp_shard
    return parallel.dp_replicate * shard * parallel.tp * parallel.pp * parallel.ep


def _local_problem(parallel: Any) -> str:
    """Why a local run cannot have the degrees ``train.parallel`` sets above 1."""
    asked = _asked_world(parallel)
    degrees = ", ".join(f"{dim}={getattr(parallel, dim)}" for dim in MESH_DIMS
                        if getattr(parallel, dim) != "auto" and getattr(parallel, dim) > 1)
    more = f" (or a multiple of {asked}: dp_shard: auto takes the rest)" if parallel.dp_shard == "auto" else ""
    return (f"train.parallel {degrees} needs a learner group of {asked} ranks, but runtime.mode=local trains the "
            f"learner in one process; set runtime.mode: ray with runtime.placement.learners={asked}{more}, or "
            "those degrees to 1")


def config_problems(cfg: Any, layout: Layout, model_config: Any, *, resolved: bool = True) -> list[str]:
    """What the rest of the run config ``cfg`` asks that ``layout`` cannot give, one line
    each: LoRA where the learners cannot write its checkpoint, ``learner_strategy: fsdp2``
    that a ``train.parallel`` layout leaves unread, and the MoE and LoRA options pipeline
    stages cannot run (``model_config``: the model's Hugging Face config, read when
    ``pp`` > 1). ``resolved``: ``layout`` is the one the run would train with (not a
    stand-in for a ``dp_shard: auto`` that did not divide the world)."""
    problems = _lora_problems(cfg)
    parallel = cfg.train.parallel
    if parallel.model_fields_set and cfg.runtime.placement.learner_strategy == "fsdp2":
        shard = f"dp_shard={parallel.dp_shard}"
        if resolved and parallel.dp_shard == "auto":
            shard += f" = {layout.dp_shard}"
        problems.append(
            f"runtime.placement.learner_strategy=fsdp2 is not read once train.parallel is set "
            f"({', '.join(sorted(parallel.model_fields_set))}): the layout is train.parallel's, which shards "
            f"parameters over its dp_shard ranks ({shard} here); remove learner_strategy and shard with "
            "train.parallel.dp_shard, or remove train.parallel to train with the FSDP2 strategy"
        )
    if layout.pp > 1:
        problems += pipeline_problems(cfg, layout.pp, model_config)
    return problems


def _lora_problems(cfg: Any) -> list[str]:
    """LoRA on Ray learners that would train and then fail at their first checkpoint: a
    ``train.parallel`` layout writes sharded checkpoints, the FSDP2 strategy gathers a
    full one, and neither can give a LoRA checkpoint."""
    if cfg.model.lora is None or cfg.runtime.mode != "ray":
        return []
    parallel = cfg.train.parallel
    if parallel.model_fields_set:
        return [f"model.lora with train.parallel set ({', '.join(sorted(parallel.model_fields_set))}) on Ray: any "
                "train.parallel key lays the learners out on a device mesh, whose checkpoints are sharded, and a "
                "LoRA checkpoint (the adapters and a fingerprint of the frozen base weights) cannot be written "
                f"from shards; {LORA_LAYOUTS}"]
    if cfg.runtime.placement.learner_strategy == "fsdp2":
        return ["model.lora with runtime.placement.learner_strategy=fsdp2: FSDP2 learners cannot write a LoRA "
                "checkpoint (the adapters and a fingerprint of the frozen base weights) from their shards; "
                f"{LORA_LAYOUTS}"]
    return []


def pipeline_problems(cfg: Any, pp: int, model_config: Any) -> list[str]:
    """The options ``pp`` (> 1) pipeline stages refuse, from the config alone: a
    vision-language model, the router load-balancing loss of an MoE model
    (``model.router_aux_loss_coef``, else the model config's own), routing replay,
    aux-free balancing, and LoRA. ``model_config``: the model's Hugging Face config (or
    an object with the same attributes; None: the model's own options unchecked)."""
    problems = []
    if model_config is not None and getattr(model_config, "vision_config", None) is not None:
        problems.append(f"train.parallel.pp={pp}: pipeline stages run token ids only, and model_type "
                        f"{getattr(model_config, 'model_type', None)!r} is a vision-language model (images go "
                        "through its vision tower first); set pp: 1")
    if model_config is not None and expert_count(model_config) > 1:  # a dense model adds no router loss
        coef = cfg.model.router_aux_loss_coef
        if coef is None and _config_value(model_config, "router_aux_loss_coef"):
            name = getattr(model_config, "model_type", "the model")
            coef = f"{_config_value(model_config, 'router_aux_loss_coef')}, {name}'s own router_aux_loss_coef"
        if coef:
            problems.append(PP_AUX_LOSS.format(coef=coef))
    if cfg.model.moe.routing_replay == "rollout":
        problems.append(PP_ROUTING_REPLAY)
    if cfg.model.moe.aux_free_bias > 0:
        problems.append(PP_AUX_FREE_BIAS)
    if cfg.model.lora is not None:
        problems.append(f"model.lora with train.parallel.pp={pp}: pipeline stages split a plain "
                        "Llama-family decoder in place, not a LoRA-wrapped model; set pp: 1")
    return problems


def _config_value(config: Any, key: str) -> Any:
    """``key`` of a model's config: its language model's (a vision-language model's text
    config), else the top level's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, key, None)
    return getattr(config, key, None) if value is None else value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = [
    "DATA_DIMS",
    "MESH_DIMS",
    "Layout",
    "LayoutError",
    "check_layout",
    "config_problems",
    "expert_count",
    "layout_for",
    "layout_problems",
    "model_config_of",
    "pipeline_problems",
    "resolve_layout",
    "run_layout",
    "run_world",
]
