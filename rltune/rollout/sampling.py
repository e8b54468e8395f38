"""Choosing the next token from logits: temperature, top-k, top-p, greedy.

Pure functions of tensors, shared by every generator that samples in torch.

A token is drawn by inverting the distribution's cumulative sum (:func:`inverse_cdf`):
one float64 uniform number a row, running sums, a binary search. It draws from the
categorical distribution that the float32 probabilities define, up to the float32
rounding of sums over blocks of them (relative ~1e-7), like ``torch.multinomial``, and
costs far less on a CPU: multinomial draws one exponential
variate per vocabulary entry (setting up a random stream a call), which for 8 rows of
Qwen2's 152 k vocabulary takes ~40 ms a token; this takes a few ms
(``benchmarks/sampling.py``, ``docs/performance.md``).
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


BLOCK = 1024
"""Vocabulary entries a block of the two-level search (:func:`inverse_cdf`)."""


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose running weight first exceeds ``uniform`` of the row's total.

    ``weights [R, V]``: non-negative, finite, at least one positive a row (unnormalised
    probabilities); ``uniform [R]``: float64 in ``[0, 1)``. Returns ``[R]`` long.

    The search has two levels (:func:`_blocks`): the running sum of the blocks' totals
    finds the block, and the point's place in that block, carried over to the block's own
    float64 running sum, finds the entry; only one block is summed entry by entry (a
    float64 running sum over a whole row of 152 k entries is several times slower). A
    token's chance is then its share of its block's float64 sum times its block's share
    of the row: the float32 weights' own shares, up to the float32 rounding of the
    blocks' totals (relative error about ``log2(BLOCK)`` float32 eps, at most ``BLOCK``).
    A token of weight 0 is never returned: its running sum equals the one before it,
    which is not above the point if its own is, and the point is held below the block's
    running total, so rounding cannot step past the block's last token of positive weight."""
    return _search(weights, _blocks(weights), uniform)


def _blocks(weights: torch.Tensor) -> torch.Tensor:
    """The cumulative sums ``[R, blocks]`` in float64 of ``weights [R, V]``'s blocks of
    :data:`BLOCK` entries, the last one shorter where ``V`` is not a multiple (one block
    of ``V`` when ``V < BLOCK``). A block is summed in the weights' dtype
    (torch's cascaded sum), the blocks' running sum in float64."""
    rows, vocab = weights.shape
    full = vocab // BLOCK
    sums = [] if full == 0 else [weights[:, : full * BLOCK].reshape(rows, full, BLOCK).sum(-1)]
    if vocab > full * BLOCK:
        sums.append(weights[:, full * BLOCK:].sum(-1, keepdim=True))
    return (sums[0] if len(sums) == 1 else torch.cat(sums, dim=1)).double().cumsum(dim=-1)


def _search(weights: torch.Tensor, cumulative: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf` over :func:`_blocks`' output."""
    total = cumulative[:, -1:]
    # fl((1 - 2^-53) T) < T for T > 0, so this binds only for a uniform of 1 from a caller
    point = torch.minimum(uniform.to(cumulative).unsqueeze(-1) * total, _below(total))  # [R, 1]
    block = torch.searchsorted(cumulative, point, right=True)  # [R, 1]: the first block past the point
    if cumulative.shape[1] == 1:
        inner, start, before, mass = weights, block, 0.0, total
    else:
        start = block * BLOCK
        index = start + torch.arange(BLOCK, device=weights.device)  # [R, BLOCK]; past V only in the last block
        inner = torch.where(index < weights.shape[1], weights.gather(1, index.clamp(max=weights.shape[1] - 1)), 0.0)
        before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)), 0.0)
        mass = cumulative.gather(1, block) - before  # > 0: the block ends above the point, which is at or past before
    within = torch.cumsum(inner, dim=-1, dtype=torch.float64)
    own = within[:, -1:]
    rest = torch.minimum((point - before) / mass * own, _below(own))
    return (start + torch.searchsorted(within, rest, right=True)).squeeze(-1)


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float below each (positive) entry of ``x``."""
    return x.nextafter(torch.zeros_like(x))


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
    logits = logits.float()  # a half-precision row's sums would be off by its rounding (~0.4 % in bf16)
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
        cumulative = _blocks(weights)
        _check_totals(cumulative[:, -1])
        device = generator.device if generator is not None else logits.device
        uniform = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator, device=device)
        tokens = _search(weights, cumulative, uniform.to(logits.device))
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _check_totals(totals: torch.Tensor) -> None:
    """Each row's weights (``totals [R]``, their sums; probabilities, so at most ``V``)
    sum to a positive total: NaN or infinite logits (which make the row's log-softmax NaN)
    or a row with every token masked fail. Checked on the host, since a draw from them
    would be meaningless; on a GPU that is one more synchronisation a token, beside the
    generator's own check that every row is done."""
    bad = ~(totals > 0)  # NaN > 0 is False
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"sampling: the next-token logits of row(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} "
            f"(of {totals.shape[0]}) hold NaN or infinite values, or mask every token; "
            "the model's output is broken (check its weights, dtype and inputs)"
        )
