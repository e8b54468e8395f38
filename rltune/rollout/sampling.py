"""Choosing the next token from logits: temperature, top-k, top-p, greedy.

Pure functions of tensors, shared by every generator that samples in torch.

A token is drawn by inverting the distribution's cumulative sum (:func:`inverse_cdf`):
one uniform number a row, the cumulative sum in float64, a binary search. It is an exact
draw from the categorical distribution (up to float64 rounding of the sums, ~1e-16 of
the mass a token), like ``torch.multinomial``, and much cheaper on a CPU: multinomial
draws one exponential variate per vocabulary entry (and sets up a fresh random stream a
call), 105 us a token for 8 rows of a 260-token vocabulary and 40 ms for 8 rows of
Qwen's 152 k, where this takes ~58 us and ~2-8 ms (``docs/performance.md``).
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


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative weight first exceeds ``uniform`` of the row's total.

    ``weights [R, V]``: non-negative, finite, at least one positive a row (unnormalised
    probabilities); ``uniform [R]``: float64 in ``[0, 1)``. Returns ``[R]`` long: the
    smallest ``i`` with ``c_i > u c_V``, ``c`` the row's cumulative sum in float64. A token
    of weight 0 is never returned (its ``c_i`` equals ``c_{i-1}``, which is not above
    ``u c_V`` if ``c_i`` is), and ``u c_V`` is held below ``c_V`` so that the rounding of
    the product cannot step past the last token of positive weight."""
    return _search(torch.cumsum(weights, dim=-1, dtype=torch.float64), uniform)


def _search(cumulative: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf` on the rows' cumulative sums ``[R, V]`` float64."""
    total = cumulative[:, -1:]
    point = torch.minimum(uniform.to(cumulative).unsqueeze(-1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cumulative, point, right=True).squeeze(-1)


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
    reports the log-prob under ``T = 1``. The draw (:func:`inverse_cdf`) takes one
    float64 uniform number a row from ``generator`` (on the generator's device). Logits
    holding NaN or infinity (a broken model or input) are an error naming the rows.
    """
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp_all = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits if temperature == 1 else logits / temperature
        logp_all = torch.log_softmax(scaled, dim=-1)
        weights = logp_all.exp()
        if top_k or top_p < 1.0:  # the kept tokens' probabilities, unnormalised
            kept = torch.isfinite(filter_logits(scaled, top_k=top_k, top_p=top_p))
            weights = torch.where(kept, weights, 0.0)
        cumulative = torch.cumsum(weights, dim=-1, dtype=torch.float64)  # [R, V]
        _check_totals(cumulative[:, -1])
        device = generator.device if generator is not None else logits.device
        uniform = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator, device=device)
        tokens = _search(cumulative, uniform.to(logits.device))
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _check_totals(totals: torch.Tensor) -> None:
    """Each row's weights (``totals [R]``, their sums) sum to a finite, positive total:
    NaN or infinite logits, or a row with every token masked, fail. Checked on the host,
    since a draw from them would be meaningless."""
    bad = ~(totals > 0) | totals.isinf()  # NaN > 0 is False
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"sampling: the next-token logits of row(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} "
            f"(of {totals.shape[0]}) hold NaN or infinite values, or mask every token; "
            "the model's output is broken (check its weights, dtype and inputs)"
        )
