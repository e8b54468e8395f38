"""What one training step of a config asks for, independent of the layout: the
``Workload`` the memory and time models read.

The algorithm's traits (does it generate, train a critic, need a reference model, learn
from pairs) come from the algorithm registry, ``rltune.algos.registry``, the one place
that knows what an algorithm is. That module imports torch (it holds the loss functions),
so it is imported inside ``workload_from_config``, not at module load: importing the
planner stays torch-free, and a ``rltune plan`` run pays torch's import (about 1.5 s) once,
rather than the planner keeping a second table of algorithms that would drift from the
registry (or miss one registered by a user).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from rltune.plan.errors import PlanError
from rltune.plan.spec import ModelSpec, Workload

if TYPE_CHECKING:
    from rltune.config import Config


def _algorithm(name: str) -> Any:
    """The registry's entry for ``name``; an unknown name is a ``PlanError`` listing the
    registered ones (the config accepts any name; the run checks it)."""
    from rltune.algos.registry import ALGORITHMS  # imports torch: see the module docstring

    if name not in ALGORITHMS:
        raise PlanError(f"algo.name {name!r} is not a registered algorithm; choose one of "
                        f"{', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def _group_size(algorithm: Any, group_size: int) -> int:
    """Rows per prompt: ``algo.group_size`` samples for an algorithm that generates (the
    runtime draws that many for every online algorithm, PPO included), 2 (chosen and
    rejected) for preference pairs, 1 for a fixed dataset of examples (SFT)."""
    if algorithm.online:
        return group_size
    return 2 if algorithm.pairs else 1


def _length(value: int | None, default: int, what: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{what} is {value!r}; it must be an integer >= 1")
    return value


def rollout_precision(train_precision: str, rollout: str) -> str:
    """The precision generation runs in: ``rollout.precision``, where ``auto`` is the
    learner's ``train.precision`` and fp8 training samples in bf16 (as the hf engine
    does: ``rltune/config/schema.py``, ``RolloutConfig.precision``)."""
    if rollout != "auto":
        return rollout
    return "bf16" if train_precision == "fp8" else train_precision


def workload_from_config(cfg: Config, *, prompt_tokens: int | None = None,
                         completion_tokens: int | None = None) -> Workload:
    """The ``Workload`` of ``cfg`` (a loaded ``rltune.config.Config``).

    ``prompt_tokens``: the prompt length to plan for (default ``data.max_prompt_tokens``,
    the longest a prompt may be). ``completion_tokens``: the completion length (default
    ``rollout.max_new_tokens``, the longest a sample may be; for algorithms that learn from
    a dataset, SFT and the preference methods, it stands for the response length, which
    the config does not bound). Raises ``PlanError`` for an unknown algorithm or a length
    below 1."""
    algorithm = _algorithm(cfg.algo.name)
    precision = cfg.train.precision
    return Workload(
        algo=cfg.algo.name,
        generates=algorithm.online,
        critic=algorithm.needs_critic,
        reference=algorithm.requires_reference(cfg.algo.kl_coef),
        prompts_per_step=cfg.train.prompts_per_step,
        group_size=_group_size(algorithm, cfg.algo.group_size),
        prompt_tokens=_length(prompt_tokens, cfg.data.max_prompt_tokens, "prompt_tokens"),
        completion_tokens=_length(completion_tokens, cfg.rollout.max_new_tokens, "completion_tokens"),
        precision=precision,
        rollout_precision=rollout_precision(precision, cfg.rollout.precision),
        lora_rank=None if cfg.model.lora is None else cfg.model.lora.r,
        model_dtype=cfg.model.dtype,
        logprob_chunk_tokens=cfg.train.logprob_chunk_tokens,
        epochs=cfg.algo.epochs,
        minibatches=cfg.algo.minibatches,
        max_staleness=cfg.runtime.max_staleness,
    )


def refused_degrees(cfg: Config, spec: ModelSpec) -> dict[str, str]:
    """What ``rltune train`` refuses for this config at any layout, each with the reason:
    the learner degrees ``tp``, ``pp``, ``ep`` above 1, and ``activation_checkpointing``
    other than none. Pipeline stages where ``rltune.parallel.layout.pipeline_problems``
    names a reason (an MoE model's router loss, routing replay, aux-free balancing, LoRA)
    or ``rltune.learner.precision.precision_problems`` does (fp16); every sharded degree
    under ``train.compile`` (it compiles whole blocks on plain tensors), and checkpointing
    with it on an MoE model (``rltune.learner.memory.prepare_memory``)."""
    from rltune.parallel.layout import pipeline_problems

    # the model config's keys that rule reads, from the planner's spec of it
    model = SimpleNamespace(model_type=spec.name, num_experts=spec.experts,
                            router_aux_loss_coef=spec.router_aux_loss_coef)
    fp16 = []
    if cfg.train.precision == "fp16":  # imports torch: a bf16 or fp32 plan stays without it
        from rltune.learner.precision import precision_problems

        fp16 = precision_problems("fp16", SimpleNamespace(pp=2))
    refused = {}
    if problems := [*pipeline_problems(cfg, 2, model), *fp16]:
        refused["pp"] = "; ".join(problems)
    if cfg.train.compile:
        for dim in ("tp", "pp", "ep") if spec.is_moe else ("tp", "pp"):
            refused.setdefault(dim, "train.compile compiles whole transformer blocks on plain tensors, not on "
                                    "tp, pp or ep shards")
        if spec.is_moe:
            refused["activation_checkpointing"] = ("train.compile with activation checkpointing is refused for a "
                                                   "mixture-of-experts model")
    return refused
