"""Splitting a batch into micro-batches by a token budget."""

from __future__ import annotations

import torch

from rltune.data.records import TrainBatch


def split_by_tokens(batch: TrainBatch, budget: int, *, unit: int = 1) -> list[TrainBatch]:
    """Micro-batches whose padded size (rows x (longest prompt + longest completion))
    stays within ``budget`` tokens; a single unit longer than the budget is its own
    micro-batch. Rows are grouped by length so little padding is computed, and each
    micro-batch is trimmed of all-padding columns.

    ``unit`` consecutive rows (``unit * k .. unit * k + unit - 1``) always travel together,
    in their order: a loss over pairs (chosen, rejected) needs both in one forward. An
    empty batch gives no micro-batch. The lengths come to the host in one transfer, and
    the split is decided there."""
    if len(batch) % unit:
        raise ValueError(f"split_by_tokens: {len(batch)} rows do not split into units of {unit}")
    if not len(batch):
        return []
    lengths = torch.stack([
        batch.attention_mask[:, : batch.prompt_len].sum(dim=1).view(-1, unit).amax(1),
        batch.attention_mask[:, batch.prompt_len :].sum(dim=1).view(-1, unit).amax(1),
    ])
    prompt_lens, comp_lens = lengths.tolist()
    # longest first; equal lengths keep their order
    order = sorted(range(len(prompt_lens)), key=lambda k: -(prompt_lens[k] + comp_lens[k]))
    if len(batch) * (max(prompt_lens) + max(comp_lens)) <= budget:
        return [batch.trim()]
    chunks: list[list[int]] = []
    current: list[int] = []
    max_p = max_c = 0
    for k in order:
        p, c = prompt_lens[k], comp_lens[k]
        new_p, new_c = max(max_p, p), max(max_c, c)
        if current and (len(current) + unit) * (new_p + new_c) > budget:
            chunks.append(current)
            current, new_p, new_c = [], p, c
        current.extend(range(k * unit, k * unit + unit))
        max_p, max_c = new_p, new_c
    chunks.append(current)
    index = torch.tensor([row for rows in chunks for row in rows], device=batch.input_ids.device)
    starts = [0]
    for rows in chunks:
        starts.append(starts[-1] + len(rows))
    return [batch.select(index[a:b]).trim() for a, b in zip(starts, starts[1:])]
