"""Log-probs of several completions of one prompt, with the prompt run once.

A GRPO batch holds ``n`` samples of each prompt in adjacent rows, a preference batch the
chosen and the rejected response of each prompt; :func:`completion_logprobs` would run
every row's prompt through the model again. Here the distinct prompts run once, with a
KV cache; the cache is copied to the rows of each prompt's group (an index, so the
gradient of every copy flows back into the one prompt forward), and the completions run
against it. The log-probs are those of the whole-sequence forward (the same positions,
the same keys); the arithmetic of the prompt is done once per group instead of once per
row. On a 3 M Qwen2 (one CPU thread) the forward and backward of 16 preference pairs
(prompts of 7 tokens, responses of 4) take 18–23 % less time, and of 16 prompts x 8
samples of 24 tokens 21–28 % less.

It runs where the model is a plain transformers causal LM (or a LoRA wrapper of one) in
this process, bare or wrapped in DDP (whose bookkeeping before and after a forward,
:func:`_as_ddp_forward`, then surrounds the two parts, so its gradient hooks and
``no_sync`` work as for a whole forward); not an FSDP or tensor-parallel wrap (their
hooks gather parameters around the whole model's forward), not an MoE or
vision-language model, and not with checkpointed or compiled blocks (their forward is
recomputed or traced without the cache). :func:`shares_prompts` says whether it applies.
A learner group in DDP and the same run in one process take the same path, so their
log-probs stay equal to the bit.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import DynamicCache, PreTrainedModel

from rltune.models.chunked import chunked_stats
from rltune.models.load import is_moe

_BLOCK_MARKS = ("_rltune_checkpointed", "_rltune_compiled")


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
                  ) -> torch.Tensor | None:
    """``[B]`` long: for each row, the index of its prompt among the distinct prompts,
    where a prompt's rows are adjacent and equal in ``input_ids[:, :prompt_len]`` and the
    mask; None when no two adjacent rows share a prompt (nothing to save)."""
    same = same_prompt_as_previous(input_ids, attention_mask, prompt_len)
    if not bool(same.any()):
        return None
    return (~same).long().cumsum(0) - 1


def same_prompt_as_previous(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
                            ) -> torch.Tensor:
    """``[B]`` bool: row ``i`` has row ``i - 1``'s prompt (``input_ids[:, :prompt_len]``
    and the mask alike); row 0 never."""
    ids, mask = input_ids[:, :prompt_len], attention_mask[:, :prompt_len]
    same = (ids[1:] == ids[:-1]).all(dim=1) & (mask[1:] == mask[:-1]).all(dim=1)  # [B - 1]
    return torch.cat([same.new_zeros(1), same])


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether :func:`shared_prompt_stats` computes what ``model``'s whole forward does
    (see the module docstring)."""
    if isinstance(model, DistributedDataParallel):
        return hasattr(model, "_pre_forward") and hasattr(model, "_post_forward") and shares_prompts(model.module)
    if isinstance(model, FSDPModule):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, PreTrainedModel) or isinstance(base, FSDPModule):
        return False
    body, head = getattr(base, "model", None), getattr(base, "lm_head", None)
    if body is None or head is None or is_moe(base) or hasattr(base, "get_image_features"):
        return False
    if any(isinstance(p, DTensor) for p in base.parameters()):
        return False
    return not any(mark in m.__dict__ for m in base.modules() for mark in _BLOCK_MARKS)


def shared_prompt_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    groups: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy)`` ``[B, C]`` of ``input_ids[:, prompt_len:]`` as
    :func:`~rltune.models.logprobs.completion_logprobs` gives them, the prompts run once
    per group of ``groups`` (:func:`prompt_groups`); ``chunk_tokens`` as there."""
    if isinstance(model, DistributedDataParallel):
        return _as_ddp_forward(model, shared_prompt_stats, input_ids, attention_mask, prompt_len, groups,
                               temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    starts = torch.cat([groups.new_ones(1), groups[1:] != groups[:-1]]).nonzero().squeeze(1)
    p_ids, p_mask = input_ids[starts, :prompt_len], attention_mask[starts, :prompt_len]
    positions = (p_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=base.config)
    cached = {cache_kwarg(base.model): cache}
    prompt_out = base.model(input_ids=p_ids, attention_mask=p_mask, position_ids=positions,
                            use_cache=True, **cached)
    hidden = prompt_out.last_hidden_state[:, -1:].index_select(0, groups)  # predicts column P
    width = input_ids.shape[1] - prompt_len
    if width > 1:  # the completion's columns but the last, which predicts past the end
        cache.batch_select_indices(groups)
        steps = torch.arange(1, width, device=input_ids.device)
        completion_out = base.model(
            input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
            position_ids=positions[:, -1:].index_select(0, groups) + steps,
            use_cache=True, **cached,
        )
        hidden = torch.cat([hidden, completion_out.last_hidden_state], dim=1)
    valid = attention_mask[:, prompt_len:].bool()
    return chunked_stats(base, hidden, input_ids[:, prompt_len:], valid,
                         temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def _as_ddp_forward(ddp: DistributedDataParallel, fn, *args, **kwargs):
    """``fn(ddp.module, *args, **kwargs)`` run as ``ddp``'s forward: DDP's steps before a
    forward (the reducer readied for this backward, unless under ``no_sync``) and after it
    (the reducer told a backward follows) surround it, as in ``DistributedDataParallel.forward``."""
    args, kwargs = ddp._pre_forward(*args, **kwargs)
    return ddp._post_forward(fn(ddp.module, *args, **kwargs))


def cache_kwarg(module: torch.nn.Module) -> str:
    """The forward argument of ``module`` that takes the KV cache: ``cache`` in newer
    transformers, ``past_key_values`` before (the cache is updated in place either way)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
