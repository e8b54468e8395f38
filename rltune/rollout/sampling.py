"""Choosing the next token from logits: temperature, top-k, top-p, greedy.

Pure functions of tensors, shared by every generator that samples in torch.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. ``logits [R, V]``.

    Top-p keeps the smallest set of tokens whose probability reaches ``top_p`` (the token
    that crosses the threshold is kept), as in Holtzman et al. 2020.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # mass strictly before each token; a token is dropped when that already reaches top_p
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. ``logits [R, V]`` (float32) → ``(tokens [R], logprobs [R])``.

    The returned log-prob is that of the chosen token under the temperature-scaled,
    *unfiltered* distribution ``log_softmax(logits / T)`` — the quantity the learner
    recomputes, so the two can be compared token by token. Greedy (``temperature == 0``)
    reports the log-prob under ``T = 1``.
    """
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp_all = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / temperature
        logp_all = torch.log_softmax(scaled, dim=-1)
        filtered = filter_logits(scaled, top_k=top_k, top_p=top_p) if (top_k or top_p < 1.0) else scaled
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
