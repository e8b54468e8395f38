"""Splitting a batch into micro-batches by a token budget."""

from __future__ import annotations

import torch

from rltune.data.records import TrainBatch


def split_by_tokens(batch: TrainBatch, budget: int) -> list[TrainBatch]:
    """Micro-batches whose padded size (rows x (longest prompt + longest completion))
    stays within ``budget`` tokens; a single row longer than the budget is its own
    micro-batch. Rows are grouped by length so little padding is computed, and each
    micro-batch is trimmed of all-padding columns."""
    prompt_lens = batch.attention_mask[:, : batch.prompt_len].sum(dim=1)
    comp_lens = batch.attention_mask[:, batch.prompt_len :].sum(dim=1)
    order = torch.argsort(prompt_lens + comp_lens, descending=True, stable=True)
    if len(batch) * int(prompt_lens.max() + comp_lens.max()) <= budget:
        return [batch.trim()]
    chunks: list[list[int]] = []
    current: list[int] = []
    max_p = max_c = 0
    for row in order.tolist():
        p, c = int(prompt_lens[row]), int(comp_lens[row])
        new_p, new_c = max(max_p, p), max(max_c, c)
        if current and (len(current) + 1) * (new_p + new_c) > budget:
            chunks.append(current)
            current, new_p, new_c = [], p, c
        current.append(row)
        max_p, max_c = new_p, new_c
    chunks.append(current)
    return [batch.select(torch.tensor(rows)).trim() for rows in chunks]
