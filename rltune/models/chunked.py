"""Completion log-probs and entropy without the ``[N, V]`` float32 logits.

At a 152 k vocabulary (Qwen's) one completion token's float32 logits take 608 kB, so
2,048 tokens take 1.2 GB, and a training step keeps several such tensors (the upcast,
the temperature-scaled copy, the softmax saved for the backward, its gradient). Only two
numbers per token are wanted: ``log p(target)`` and the entropy.

:func:`chunked_head` stands in for a causal LM's ``lm_head`` for the length of one
forward, so that the model's own forward still runs whole (MoE aux loss, router logits,
routing replay, a DDP or FSDP2 wrapper's hooks, LoRA's ``modules_to_save`` copy of the
head all behave as usual). It receives the final hidden states at the completion
positions, keeps the attended ones (padding costs no head compute), and applies the real
head, the temperature, the log-softmax gather and the entropy to ``chunk_tokens`` of them
at a time. With gradients, each chunk runs under non-reentrant
``torch.utils.checkpoint``: only its ``[c, H]`` hidden states are saved, and the chunk's
logits are recomputed in the backward, one chunk at a time. The cost is one more forward
of the head per token when there is more than one chunk; a single chunk runs plainly.

A tensor-parallel head (``rltune.parallel.tensor``) gets each chunk as a replicated
DTensor and returns it sharded on the vocabulary; the chunk's statistics are then read
shard by shard (:func:`rltune.models.vocab_parallel.vocab_parallel_token_stats`), so the
logits are chunked over the sequence and split over the vocabulary at once.

Logit transforms that a model family applies after its head (Gemma's
``final_logit_softcapping``, Granite's ``logits_scaling``, Cohere's ``logit_scale``) are
applied to each chunk as the model's forward would (:func:`logit_transform`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from rltune.models.vl_inputs import placeholder_ids, suppress_placeholders
from rltune.models.vocab_parallel import vocab_parallel_token_stats, vocab_shard

DEFAULT_CHUNK_TOKENS = 1024
"""Completion tokens per chunk when the model carries no setting (``train.logprob_chunk_tokens``):
at a 152 k vocabulary a chunk's float32 logits are 0.6 GB, at 32 k 0.13 GB."""

CHUNK_ATTR = "rltune_logprob_chunk_tokens"
"""The attribute of a causal LM that holds its chunk size (:func:`set_logprob_chunk_tokens`)."""


def head_owner(model: nn.Module) -> nn.Module | None:
    """The module whose forward applies ``lm_head`` (a causal LM), found through any
    wrapper (DDP, peft's ``PeftModel``); None when there is none."""
    for module in model.modules():
        if isinstance(module._modules.get("lm_head"), nn.Module):
            return module
    return None


def set_logprob_chunk_tokens(model: nn.Module, tokens: int) -> None:
    """Record on ``model`` (a causal LM, or a wrapper of one) how many completion tokens
    one chunk of its log-probs takes; 0 computes them from the full logits. Stored on the
    model so that every caller of :func:`rltune.models.logprobs.completion_logprobs` on it
    (the learner, the reference, a preference learner's reference pass) uses it."""
    if tokens < 0:
        raise ValueError(f"logprob chunk size {tokens} must be >= 0 (0: the full logits)")
    owner = head_owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} has no `lm_head` to compute log-probs with in chunks")
    setattr(owner, CHUNK_ATTR, int(tokens))


def _chunk_size(tokens: object) -> int:
    """``tokens`` as an int; a bool or a float is refused (TypeError)."""
    if isinstance(tokens, bool) or not hasattr(tokens, "__index__"):
        raise TypeError(f"chunk_tokens={tokens!r} ({type(tokens).__name__}) must be an int")
    return tokens.__index__()


def logprob_chunk_tokens(model: nn.Module) -> int:
    """The chunk size recorded on ``model`` (:func:`set_logprob_chunk_tokens`), else
    :data:`DEFAULT_CHUNK_TOKENS`; 0 (its own logits, read whole) for a model without an
    ``lm_head``, whose forward is the only way to its logits."""
    owner = head_owner(model)
    return int(getattr(owner, CHUNK_ATTR, DEFAULT_CHUNK_TOKENS)) if owner is not None else 0


def logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's forward does to ``lm_head``'s output before returning it as logits:
    soft-capping ``cap * tanh(z / cap)``, a division by ``logits_scaling`` or a product with
    ``logit_scale``; the identity for the Llama family (and most others)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    divide = getattr(text, "logits_scaling", None)
    scale = getattr(text, "logit_scale", None)

    def apply(z: torch.Tensor) -> torch.Tensor:
        if cap:
            z = torch.tanh(z / cap) * cap
        if divide:
            z = z / divide
        if scale:
            z = z * scale
        return z

    return apply


def policy_logits(owner: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`logit_transform` of the module that applies ``lm_head``, then, for a
    vision-language model, its image placeholders suppressed as the generator suppresses
    them (:mod:`rltune.models.vl_inputs`)."""
    config = getattr(owner, "config", None)
    transform = logit_transform(config) if config is not None else (lambda z: z)
    placeholders = placeholder_ids(owner)
    return (lambda z: suppress_placeholders(transform(z), placeholders)) if placeholders else transform


class ChunkedHead(nn.Module):
    """The stand-in ``lm_head`` of one forward (:func:`chunked_head`). It receives the
    hidden states ``[B, C + 1, H]`` at positions ``P - 1 .. T - 1`` (``logits_to_keep``;
    ``[B, C, H]`` when the forward left out the last column),
    stores ``(logprobs, entropy)`` ``[B, C]`` in :attr:`result` and returns a width-0
    tensor in place of the logits. :attr:`width` is the number of positions it received
    (a model that ignores ``logits_to_keep`` hands it all ``T``). ``chunk_tokens`` is an
    int >= 1."""

    def __init__(self, head: nn.Module, targets: torch.Tensor, valid: torch.Tensor, *, temperature: float,
                 with_entropy: bool, chunk_tokens: int, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if _chunk_size(chunk_tokens) < 1:
            raise ValueError(f"ChunkedHead: chunk_tokens={chunk_tokens} must be >= 1")
        super().__init__()
        self.head = head
        self.targets, self.valid = targets, valid
        self.temperature, self.with_entropy = temperature, with_entropy
        self.chunk_tokens, self.transform = chunk_tokens, transform
        self.result: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.width: int | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.width = hidden.shape[1]
        if self.width in (self.targets.shape[1], self.targets.shape[1] + 1):  # without or with the last column
            self.result = self.stats(hidden[:, : self.targets.shape[1]])
        return hidden[..., :0]

    def stats(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and entropy ``[B, C]`` (0 on padding) from hidden states ``[B, C, H]``."""
        mesh = None
        if isinstance(hidden, DTensor):  # sequence parallel: gather the positions, then chunk them
            mesh = hidden.device_mesh
            hidden = hidden.redistribute(placements=[Replicate()] * mesh.ndim).to_local()
        rows, cols, width = hidden.shape
        where = self.valid.reshape(-1).nonzero().squeeze(1)
        picked = hidden.reshape(rows * cols, width).index_select(0, where)
        targets = self.targets.reshape(-1).index_select(0, where)
        logps, entropies = [], []
        step = self.chunk_tokens
        many = len(where) > step and torch.is_grad_enabled()
        for start in range(0, len(where), step):
            args = (picked[start : start + step], targets[start : start + step], mesh)
            logp, entropy = checkpoint(self._chunk, *args, use_reentrant=False) if many else self._chunk(*args)
            logps.append(logp)
            entropies.append(entropy)
        flat = torch.zeros(rows * cols, dtype=torch.float32, device=picked.device)
        logprobs = flat.index_copy(0, where, torch.cat(logps) if logps else flat[:0])
        entropy = None
        if self.with_entropy:
            entropy = flat.index_copy(0, where, torch.cat(entropies) if entropies else flat[:0]).view(rows, cols)
        return logprobs.view(rows, cols), entropy

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor, mesh: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk: ``[c, H]`` hidden states -> ``(log p(target), entropy)`` ``[c]`` float32."""
        from rltune.models.logprobs import entropy_from_logits, token_logprobs

        if mesh is not None:
            hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
        logits = self.transform(self.head(hidden)).float() / self.temperature
        sharded = vocab_shard(logits)
        if sharded is None:
            entropy = entropy_from_logits(logits) if self.with_entropy else None
            return token_logprobs(logits, targets), entropy
        local, group, start = sharded
        logp, entropy = vocab_parallel_token_stats(local, targets, group, start, with_entropy=self.with_entropy)
        return logp, entropy.detach() if entropy is not None else None


def chunked_stats(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, *,
                  temperature: float, with_entropy: bool, chunk_tokens: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy)`` ``[B, C]`` from final hidden states ``[B, C, H]`` at the
    completion positions, with ``model``'s own ``lm_head`` in chunks of ``chunk_tokens``
    (None: its :func:`logprob_chunk_tokens`; 0: one chunk; a negative size is refused).
    For callers that run the body themselves (the last pipeline stage, the shared-prompt
    forward)."""
    chunk = logprob_chunk_tokens(model) if chunk_tokens is None else _chunk_size(chunk_tokens)
    if chunk < 0:
        raise ValueError(f"chunked_stats: chunk_tokens={chunk_tokens} must be >= 0 (0: one chunk) or None")
    tokens = chunk or max(1, hidden.shape[0] * hidden.shape[1])
    head = ChunkedHead(model.lm_head, targets, valid, temperature=temperature, with_entropy=with_entropy,
                       chunk_tokens=tokens, transform=policy_logits(model))
    return head.stats(hidden)


@contextlib.contextmanager
def chunked_head(model: nn.Module, targets: torch.Tensor, valid: torch.Tensor, *, temperature: float,
                 with_entropy: bool, chunk_tokens: int) -> Iterator[ChunkedHead]:
    """Within the block, ``model``'s ``lm_head`` is a :class:`ChunkedHead` around the real
    one (restored on exit, also on error). ``targets`` ``[B, C]`` are the completion tokens,
    ``valid`` ``[B, C]`` their attention mask."""
    owner = head_owner(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} has no `lm_head`: chunked log-probs apply the LM head "
                         f"themselves; set train.logprob_chunk_tokens: 0 to read the model's logits instead")
    head = owner._modules["lm_head"]
    stand_in = ChunkedHead(head, targets, valid, temperature=temperature, with_entropy=with_entropy,
                           chunk_tokens=chunk_tokens, transform=policy_logits(owner))
    owner._modules["lm_head"] = stand_in
    try:
        yield stand_in
    finally:
        owner._modules["lm_head"] = head


__all__ = [
    "CHUNK_ATTR",
    "DEFAULT_CHUNK_TOKENS",
    "ChunkedHead",
    "chunked_head",
    "chunked_stats",
    "head_owner",
    "logit_transform",
    "logprob_chunk_tokens",
    "set_logprob_chunk_tokens",
]
