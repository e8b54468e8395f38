"""The work one sample costs in a forward: a causal sequence's FLOPs, and what the
learner computes per sample when a group's rows share their prompt
(``rltune/models/shared_prompt.py``). Split from :mod:`rltune.plan.timing`, which uses
and re-exports these."""

from __future__ import annotations

from rltune.plan import catalogue
from rltune.plan.spec import Candidate, ModelSpec, Workload


def sequence_flops(spec: ModelSpec, tokens: int) -> tuple[float, float]:
    """``(matmul, attention)`` forward FLOPs of one causal sequence of ``tokens`` tokens:
    ``sum_{i=1..S} F(i) = S x F(0) + S x (F((S+1)/2) - F(0))`` with ``F`` the catalogue's
    per-token FLOPs (affine in the context)."""
    base = catalogue.forward_flops_per_token(spec, 0)
    mean = catalogue.forward_flops_per_token(spec, (tokens + 1) / 2)
    return tokens * base, tokens * (mean - base)


def shares_prompts(spec: ModelSpec, work: Workload, cand: Candidate) -> bool:
    """Whether the learner runs each prompt once for the rows that share it
    (``rltune/models/shared_prompt.py``): a group of more than one row (GRPO's samples,
    DPO's chosen and rejected), a dense model, a learner in one process or DDP (no FSDP
    shard, TP, PP or EP) and no activation checkpointing."""
    lay = cand.learner
    return (work.group_size > 1 and not spec.experts and cand.activation_checkpointing == "none"
            and lay.dp_shard == lay.tp == lay.pp == lay.ep == 1)


def learner_sample_work(spec: ModelSpec, work: Workload, cand: Candidate) -> tuple[float, float, float]:
    """``(matmul, attention, tokens)`` of one sample in a learner forward:
    ``sequence_flops(P + C)``, or, where the prompt runs once per group
    (:func:`shares_prompts`), the completion's share ``sequence_flops(P + C) -
    sequence_flops(P)`` plus ``sequence_flops(P) / group_size`` (tokens ``C + P / group_size``)."""
    linear, attention = sequence_flops(spec, work.tokens_per_sample)
    if not shares_prompts(spec, work, cand):
        return linear, attention, float(work.tokens_per_sample)
    p_linear, p_attention = sequence_flops(spec, work.prompt_tokens)
    saved = 1.0 - 1.0 / work.group_size
    return (linear - saved * p_linear, attention - saved * p_attention,
            work.tokens_per_sample - saved * work.prompt_tokens)
