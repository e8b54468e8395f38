"""Config sections for models bigger than one device: the learner group's layout
(``train.parallel``) and MoE options (``model.moe``). Imports no torch.

See ``docs/parallel.md``; ``rltune.parallel.layout`` checks a layout against the world
size and the model before anything is loaded.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # no setting is infinite or NaN


Degree = Annotated[int, Field(ge=1, strict=True)]
"""A number of ranks: a whole number, at least 1 (``true`` or ``2.0`` are not taken for one)."""


class ParallelConfig(_Section):
    """The learner group as one DeviceMesh of ``pp x dp_replicate x dp_shard x ep x tp``
    ranks; the product is the group's size (``runtime.placement.learners`` on Ray, the
    number of processes under torchrun)."""

    dp_replicate: Degree = 1
    """Data-parallel replicas: each holds the whole (tp/pp/ep-sharded) model and its own
    rows; gradients are all-reduced (DDP; HSDP together with ``dp_shard``)."""
    dp_shard: Degree | Literal["auto"] = "auto"
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2);
    ``auto``: what is left of the world after the other degrees."""
    tp: Degree = 1
    """Tensor parallelism: attention heads, MLP columns and the vocabulary split over this
    many ranks, which see the same rows."""
    pp: Degree = 1
    """Pipeline stages: the layers split into this many consecutive stages."""
    ep: Degree = 1
    """Expert parallelism (MoE models): the experts split over this many ranks, tokens sent
    to their experts by all-to-all; the ranks train on different rows (data parallel for
    every weight but the experts)."""
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule with ``pp`` > 1: GPipe (every forward, then every backward) or
    1F1B (interleaved; fewer activations held)."""
    sequence_parallel: bool = False
    """With ``tp`` > 1: the norms and residual stream sharded over the sequence between
    the tensor-parallel regions (less activation memory, the same result)."""

    @field_validator("dp_shard", mode="before")
    @classmethod
    def _dp_shard(cls, value: object) -> object:
        """One message for a value that is neither (rather than one per member of the union)."""
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(f"must be a whole number >= 1 or 'auto' (got {value!r})")


class MoeConfig(_Section):
    """MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): how experts run and are routed."""

    routing_replay: Literal["off", "rollout"] = "off"
    """``rollout``: the generator records which experts each token was routed to, and the
    learner's forward routes through those experts instead of recomputing the choice
    (the policy gradient is taken through the experts that produced the sample)."""
    aux_free_bias: float = Field(0.0, ge=0)
    """Auxiliary-loss-free load balancing: after each step every expert's routing bias
    moves by this much toward an even load (0: off). The bias changes which experts are
    chosen, not their weights."""


def moe_problems(moe: MoeConfig, *, engine: str, env: str | None, lora: bool = False) -> list[str]:
    """``model.moe`` options the rollout side (``rollout.engine``, ``env.name``) or the
    checkpoint (``lora``: adapters only) cannot honour. A dense model with either option
    is refused when it loads: the config does not know the architecture."""
    problems = []
    if moe.aux_free_bias > 0 and lora:
        problems.append(
            "model.moe.aux_free_bias with model.lora: a LoRA checkpoint saves the adapters only, "
            "so the routing bias would be lost on resume; train without LoRA, or aux_free_bias: 0"
        )
    replay = moe.routing_replay == "rollout"
    if replay and engine == "vllm":
        problems.append(
            "model.moe.routing_replay: rollout needs the experts each generated token was routed "
            "to; vLLM's generate API returns tokens and log-probs only, so there is nothing to "
            "replay: use rollout.engine=hf, or routing_replay: off"
        )
    if moe.aux_free_bias > 0 and engine == "vllm":
        problems.append(
            "model.moe.aux_free_bias adds a per-expert bias buffer to rltune's routers, which "
            "vLLM's MoE layers do not have: generation would route differently from the learner; "
            "use rollout.engine=hf, or aux_free_bias: 0"
        )
    if replay and env is not None:
        problems.append(
            "model.moe.routing_replay: rollout with env.name: a multi-turn episode is joined from "
            "several generations and environment turns, whose tokens have no recorded routes; set "
            "routing_replay: off for environment runs"
        )
    return problems
