"""Log-probabilities of completion tokens under a causal LM, for training and scoring.

Layout (see :class:`rltune.data.records.TrainBatch`): ``input_ids``/``attention_mask``
are ``[B, T]``, the prompt left-padded to ``P = prompt_len`` columns, then the completion
right-padded to ``C = T - P`` columns. The token in column ``P + j`` is predicted by the
logits at column ``P + j - 1``, so exactly the ``C`` positions ``P - 1 .. T - 2`` need
logits; the lm_head is applied to those only (``logits_to_keep``), never to the prompt,
and, by default, to a chunk of them at a time (:mod:`rltune.models.chunked`). A dense
Qwen2 / Llama / Mistral model that :mod:`rltune.models.lean_forward` supports runs that
module's forward instead of the transformers one: the same arithmetic, less overhead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rltune.data.records import VisionInputs
from rltune.models.chunked import chunked_head, head_owner, logprob_chunk_tokens
from rltune.models.lean_forward import lean_completion_logprobs, supports_lean_forward
from rltune.models.load import is_moe
from rltune.models.routing import installed_routers, routing_pass
from rltune.models.shared_prompt import prompt_groups, shared_prompt_stats, shares_prompts
from rltune.models.vl_inputs import (
    model_vision_inputs,
    mrope_owner,
    mrope_positions,
    placeholder_ids,
    suppress_placeholders,
)
from rltune.models.vocab_parallel import vocab_parallel_token_stats, vocab_shard


@dataclass
class LogProbOutput:
    """What :func:`completion_logprobs` returns.

    ``logprobs`` ``[B, C]`` float32: ``log p(input_ids[b, P + j] | input_ids[b, :P + j])``
    under the temperature-scaled distribution, differentiable; 0 where the completion
    column is padding. ``entropy`` ``[B, C]`` float32 (no grad) of the same distribution at
    the same positions, 0 on padding, or None when not asked for. ``aux_loss`` is the
    router load-balancing loss (0-dim) of an MoE model when asked for, else None.
    ``expert_load`` ``[L, E]`` (no grad), with ``aux_loss``: per layer, how many of the
    attended tokens' top-k routing choices went to each expert.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    route_agreement: torch.Tensor | None = None
    """``[2]`` (no grad) when the batch carried recorded routes: how many (completion
    token, MoE layer) routes the learner's router chose as recorded, of how many compared
    (:mod:`rltune.models.routing`)."""


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions that count only attended tokens: ``cumsum(mask) - 1``, floored at 0.

    With left padding the first real token gets position 0, as it would unpadded, so the
    rotary phases (and hence the log-probs) do not depend on how much padding a row has.
    Any nonzero entry counts as one attended token.
    """
    return ((attention_mask != 0).long().cumsum(dim=-1) - 1).clamp(min=0)


def body_hidden_states(
    body: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    vision: VisionInputs | None = None,
) -> torch.Tensor:
    """``[B, T, H]`` last hidden states of a transformer body (an LM without its head),
    positions from the mask as in :func:`completion_logprobs`; for value and score heads.
    ``vision``: a vision-language body's pixel inputs, as :func:`completion_logprobs` takes them."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
              "position_ids": position_ids_from_mask(attention_mask)}
    return body(**_vision_inputs(body, inputs, vision), use_cache=False).last_hidden_state


def causal_suffices(attention_mask: torch.Tensor) -> bool:
    """True when no row of ``attention_mask`` ``[B, T]`` has left padding (each row is
    ones then zeros). A causal mask then gives every attended position the same keys as
    the padding mask (right padding only follows it), so the model can run without the
    mask (the SDPA causal kernel, no ``[B, 1, T, T]`` mask built); the padded positions'
    outputs differ, and nothing reads them. One host sync: the choice is made on the host."""
    ones_then_zeros = attention_mask[:, 0].bool().all() & (attention_mask.diff(dim=1) <= 0).all()
    return bool(ones_then_zeros)


def _forward_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, whole: bool
                    ) -> dict[str, torch.Tensor | None]:
    """The ids, mask and positions the model's forward gets.

    The last column is left out unless ``whole``: its hidden state predicts past the end
    and no earlier position attends to it (``whole`` when the routing is read: the router
    loss, the load counts and the recorded routes cover every token). Without left padding
    (:func:`causal_suffices`) there is no mask, and the positions are ``0 .. T - 2`` in
    every row: the attended ones are those of the mask, and, unlike the mask's (flat over
    the right padding), they tell the model that a row is one sequence, not packed ones,
    so it builds no mask at all (SDPA's causal kernel)."""
    ids, mask = (input_ids, attention_mask) if whole else (input_ids[:, :-1], attention_mask[:, :-1])
    if not whole and causal_suffices(mask):
        positions = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape[0], -1)
        return {"input_ids": ids, "attention_mask": None, "position_ids": positions}
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


def _vision_inputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor | None],
                   vision: VisionInputs | None) -> dict[str, torch.Tensor | None]:
    """The forward's inputs with a vision-language batch's pixel inputs added and, for an
    M-RoPE model, its 3-D positions from the model's own rope index with the mask always
    passed (:mod:`rltune.models.vl_inputs`); the generator's positions, so the same
    log-probs."""
    if vision is None:
        return inputs
    ids = inputs["input_ids"]
    out = {**inputs, **model_vision_inputs(vision, ids.device)}
    owner = mrope_owner(model)
    if owner is not None:
        mask = out["attention_mask"]
        mask = torch.ones_like(ids) if mask is None else mask
        out["attention_mask"], out["position_ids"] = mask, mrope_positions(owner, ids, mask, vision)[0]
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` as ``logits[target] - logsumexp(logits)``.

    ``logits`` ``[..., V]``, ``targets`` ``[...]`` long; returns ``[...]`` in the dtype of
    ``logits``. The gather avoids a second ``[..., V]`` tensor that ``log_softmax`` makes.
    """
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum_v p_v z_v``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    output_router_logits: bool = False,
    routes: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    vision: VisionInputs | None = None,
) -> LogProbOutput:
    """Per-token log-probs of ``input_ids[:, prompt_len:]`` given their prefixes.

    ``logp[b, j] = z[tok] - logsumexp(z)`` with ``z = logits[b, P + j - 1] / temperature``,
    in float32 even when the model runs in bfloat16. ``temperature`` (positive) must be the
    sampler's, so the log-probs are those of the distribution the tokens were drawn from.

    ``position_ids`` come from ``attention_mask`` (:func:`position_ids_from_mask`), so left
    padding does not shift positions. The forward leaves out the last column, and without
    left padding the mask (:func:`_forward_inputs`); rows that share their prompt run it
    once where the model allows (:mod:`rltune.models.shared_prompt`): the same log-probs,
    less work. With ``output_router_logits`` an MoE model also returns its router
    load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4–6, over the attended
    tokens of the whole sequence) as ``aux_loss``; a dense model None.

    ``routes`` ``[B, T, L, k]``: the experts the generator routed each token to; a model
    installed with replay (:func:`rltune.models.routing.install_routing`) routes through
    them, and the output's ``route_agreement`` counts how often its own router agrees.
    ``chunk_tokens``: the head runs on that many completion tokens at a time
    (:mod:`rltune.models.chunked`): the ``[B, C, V]`` float32 logits are never whole; 0
    reads the full logits; None: the model's ``train.logprob_chunk_tokens``.
    ``vision``: a vision-language batch's pixel inputs, the rows' concatenated in order
    (:func:`rltune.models.vision.batch_vision_inputs`); image tokens are prompt tokens.

    Checked (shapes, dtypes, Python numbers; nothing that reads the tensors): ``B >= 1``,
    integer ``input_ids``, an int ``prompt_len``, ``chunk_tokens`` None or an int >= 0.
    ``attention_mask`` may be bool, 0/1 or any other values: a nonzero entry is attended.
    A token id outside the vocabulary fails the embedding lookup; on the CPU that error
    is re-raised as a ValueError naming the ids' range and the vocabulary size (on a GPU
    the lookup's device-side assert fires first).
    """
    prompt_len = _check_inputs(input_ids, attention_mask, prompt_len, temperature, chunk_tokens)
    if attention_mask.dtype != torch.bool:  # attended = nonzero, in positions and attention alike
        attention_mask = (attention_mask != 0).to(attention_mask.dtype)
    try:
        return _logprobs(model, input_ids, attention_mask, prompt_len, temperature, with_entropy,
                         output_router_logits, routes, chunk_tokens, vision)
    except IndexError as err:
        problem = _out_of_vocabulary(model, input_ids)
        if problem is None:
            raise
        raise ValueError(problem) from err


def _logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
              temperature: float, with_entropy: bool, output_router_logits: bool, routes: torch.Tensor | None,
              chunk_tokens: int | None, vision: VisionInputs | None) -> LogProbOutput:
    """:func:`completion_logprobs` on checked arguments."""
    extra = {"output_router_logits": True} if output_router_logits and is_moe(model) else {}
    valid = attention_mask[:, prompt_len:].bool()  # [B, C]
    targets = input_ids[:, prompt_len:]
    whole = bool(extra) or routes is not None or bool(installed_routers(model))
    if (shared := _shared_prompt_output(model, input_ids, attention_mask, prompt_len, temperature, with_entropy,
                                        whole or vision is not None, chunk_tokens)) is not None:
        return shared
    inputs = _vision_inputs(model, _forward_inputs(input_ids, attention_mask, whole=whole), vision)
    keep = inputs["input_ids"].shape[1] - prompt_len + 1  # positions P - 1 .. end: C + 1 (whole) or C
    head = _head(model, targets, valid, temperature, with_entropy, chunk_tokens)
    with routing_pass(model, attention_mask, prompt_len, routes=routes, count_load=bool(extra)) as routed, \
            head as stand_in:
        out = model(**inputs, use_cache=False, logits_to_keep=keep, **extra)
    _check_width(model, out.logits.shape[1] if stand_in is None else stand_in.width, keep)
    logprobs, entropy = stand_in.result if stand_in is not None else _token_stats(
        suppress_placeholders(out.logits[:, : targets.shape[1]].float(), placeholder_ids(head_owner(model)))
        / temperature, targets, valid, with_entropy)  # [B, C, V] logits
    aux_loss = out.aux_loss if extra else None
    # installed routers count the experts they actually chose (replayed, biased)
    load = routed.load if routed.load is not None or not extra else expert_load(
        model, out.router_logits, attention_mask)
    return LogProbOutput(logprobs=logprobs, entropy=entropy, aux_loss=aux_loss, expert_load=load,
                         route_agreement=routed.agreement)


def _shared_prompt_output(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prompt_len: int, temperature: float, with_entropy: bool, whole: bool,
                          chunk_tokens: int | None) -> LogProbOutput | None:
    """The log-probs from the lean forward where the model allows it and the forward need
    not cover whole rows (:mod:`rltune.models.lean_forward`), else with each distinct
    prompt run once where rows share prompts and the model allows it
    (:mod:`rltune.models.shared_prompt`); None otherwise."""
    if not whole and supports_lean_forward(model):
        logprobs, entropy = lean_completion_logprobs(model, input_ids, attention_mask, prompt_len,
                                                     temperature=temperature, with_entropy=with_entropy,
                                                     chunk_tokens=chunk_tokens)
        return LogProbOutput(logprobs=logprobs, entropy=entropy)
    groups = None if whole or not shares_prompts(model) else prompt_groups(input_ids, attention_mask, prompt_len)
    if groups is None:
        return None
    logprobs, entropy = shared_prompt_stats(model, input_ids, attention_mask, prompt_len, groups,
                                            temperature=temperature, with_entropy=with_entropy,
                                            chunk_tokens=chunk_tokens)
    return LogProbOutput(logprobs=logprobs, entropy=entropy)


def _token_stats(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and (no-grad) entropy, 0 where not ``valid``; logits that a
    tensor-parallel ``lm_head`` left split over the vocabulary are read shard by shard
    (:func:`rltune.models.vocab_parallel.vocab_parallel_token_stats`), never gathered."""
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    sharded = vocab_shard(logits)
    if sharded is None:
        logprobs = token_logprobs(logits, targets)
        entropy = entropy_from_logits(logits) if with_entropy else None
    else:
        local, group, start = sharded
        logprobs, entropy = vocab_parallel_token_stats(local, targets, group, start, with_entropy=with_entropy)
    entropy = torch.where(valid, entropy.detach(), zero) if with_entropy else None
    return torch.where(valid, logprobs, zero), entropy


@torch.no_grad()
def expert_load(model: torch.nn.Module, router_logits: tuple[torch.Tensor, ...],
                attention_mask: torch.Tensor) -> torch.Tensor:
    """``[L, E]`` counts of the attended tokens' top-k routing choices per layer and
    expert (``router_logits``: one ``[B*T, E]`` tensor per MoE layer, as HF returns them;
    k is the config's ``num_experts_per_tok``)."""
    k = int(getattr(model.config, "num_experts_per_tok", 1) or 1)
    attended = attention_mask.reshape(-1).bool()
    rows = []
    for logits in router_logits:
        chosen = logits[attended.to(logits.device)].topk(k, dim=-1).indices.reshape(-1)
        rows.append(torch.bincount(chosen, minlength=logits.shape[-1]))
    return torch.stack(rows).float()


def _head(model: torch.nn.Module, targets: torch.Tensor, valid: torch.Tensor, temperature: float,
          with_entropy: bool, chunk_tokens: int | None) -> contextlib.AbstractContextManager:
    """The chunked stand-in for the model's head during its forward, or nothing (full logits)."""
    chunk = logprob_chunk_tokens(model) if chunk_tokens is None else chunk_tokens
    if chunk <= 0:
        return contextlib.nullcontext()
    return chunked_head(model, targets, valid, temperature=temperature, with_entropy=with_entropy,
                        chunk_tokens=chunk)


def _check_width(model: torch.nn.Module, width: int | None, wanted: int) -> None:
    """The model must honour ``logits_to_keep`` (the head sees ``wanted`` positions)."""
    if width != wanted:
        raise ValueError(
            f"{type(model).__name__} returned logits for {width} positions, "
            f"not the {wanted} asked for with `logits_to_keep`; it does not "
            f"support that argument, which rltune needs to skip the prompt's logits"
        )


def _out_of_vocabulary(model: torch.nn.Module, input_ids: torch.Tensor) -> str | None:
    """Why ``input_ids`` do not fit ``model``'s input embedding, or None when they do (or
    the size is unknown). Reads the ids: for the error path only."""
    vocab = None
    for module in model.modules():
        get = getattr(module, "get_input_embeddings", None)
        if callable(get):
            with contextlib.suppress(NotImplementedError, AttributeError):
                vocab = getattr(get(), "num_embeddings", None)
            break
    if vocab is None or input_ids.numel() == 0:
        return None
    low, high = int(input_ids.min()), int(input_ids.max())
    if 0 <= low and high < vocab:
        return None
    return (f"input_ids hold token ids from {low} to {high}, outside the model's vocabulary of "
            f"{vocab} (ids 0 .. {vocab - 1}): a pad id or another tokenizer's ids?")


def _check_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, temperature: float,
    chunk_tokens: int | None = None,
) -> int:
    """Shapes, dtypes and numbers of :func:`completion_logprobs`; returns ``prompt_len`` as an int."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: no rows; expected B >= 1")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids has dtype {input_ids.dtype}; expected integer token ids (torch.long)")
    prompt_len = _as_int(prompt_len, "prompt_len")
    if chunk_tokens is not None and _as_int(chunk_tokens, "chunk_tokens") < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 0 (0: the full logits) or None")
    if not 1 <= prompt_len < input_ids.shape[1]:
        raise ValueError(
            f"prompt_len {prompt_len} must be at least 1 (the first completion token needs a "
            f"prefix) and less than the sequence length {input_ids.shape[1]}"
        )
    if not temperature > 0:
        raise ValueError(
            f"temperature {temperature} must be positive; greedy decoding (temperature 0) "
            f"has no log-probs, score it with temperature 1"
        )
    return prompt_len


def _as_int(value: object, name: str) -> int:
    """``value`` as an int; a bool or a float is refused (``True`` is not a length)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be an int")
    return value.__index__()
