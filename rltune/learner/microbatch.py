"""Splitting a batch into micro-batches by a token budget."""

from __future__ import annotations

import torch

from rltune.data.records import TrainBatch
from rltune.models.shared_prompt import same_prompt_as_previous


def split_by_tokens(batch: TrainBatch, budget: int, *, unit: int = 1, shared: bool = True) -> list[TrainBatch]:
    """Micro-batches whose padded size (rows x (longest prompt + longest completion))
    stays within ``budget`` tokens; a single unit longer than the budget is its own
    micro-batch. Each micro-batch is trimmed of all-padding columns.

    ``unit`` consecutive rows (``unit * k .. unit * k + unit - 1``) always travel together,
    in their order: a loss over pairs (chosen, rejected) needs both in one forward. An
    empty batch gives no micro-batch.

    Two splits are weighed. The length split orders units longest-first (prompt +
    completion; equal lengths keep their order) and fills micro-batches greedily, so little
    padding is computed. Where adjacent rows share a prompt (a GRPO batch's samples, see
    :func:`rltune.models.shared_prompt.prompt_groups`), the group split keeps each group's
    units together and in order: groups longest-first by their longest unit, a group that
    does not fit what is left of a micro-batch starts the next, one larger than the budget
    is cut into consecutive pieces. Each split's cost is the tokens it computes,

        sum over micro-batches m of  n_m * (P_m + C_m)  -  sum over runs r in m of (k_r - 1) * P_m

    with ``n_m`` rows, ``P_m``/``C_m`` its longest prompt/completion, and ``k_r`` the length
    of each run of adjacent rows of one prompt in m (the shared-prompt forward runs that
    prompt once). The group split is taken only when it costs strictly less, so a batch
    without shared prompts, or one whose prompts are too short to pay for the padding,
    splits as the length split; so does every batch with ``shared=False``, for a model
    that runs every row's prompt (:func:`rltune.models.shared_prompt.shares_prompts`). The
    lengths and the prompt equalities come to the host in one transfer, and the split is
    decided there."""
    if len(batch) % unit:
        raise ValueError(f"split_by_tokens: {len(batch)} rows do not split into units of {unit}")
    if not len(batch):
        return []
    mask, width = batch.attention_mask, batch.prompt_len
    same = same_prompt_as_previous(batch.input_ids, mask, width)
    rows = torch.stack([mask[:, :width].sum(1), mask[:, width:].sum(1), same.long()])
    p_row, c_row, same_row = rows.tolist()
    prompt_lens = [max(p_row[k * unit: k * unit + unit]) for k in range(len(batch) // unit)]
    comp_lens = [max(c_row[k * unit: k * unit + unit]) for k in range(len(batch) // unit)]
    if len(batch) * (max(prompt_lens) + max(comp_lens)) <= budget:
        return [batch.trim()]
    # longest first; equal lengths keep their order
    order = sorted(range(len(prompt_lens)), key=lambda k: -(prompt_lens[k] + comp_lens[k]))
    chunks = _pack([[k] for k in order], prompt_lens, comp_lens, budget, unit)
    if shared and any(same_row):
        group = [0]
        for flag in same_row[1:]:
            group.append(group[-1] + 1 - flag)
        runs = _unit_groups(same_row, prompt_lens, comp_lens, unit)
        grouped = _pack(runs, prompt_lens, comp_lens, budget, unit)
        if split_cost(grouped, p_row, c_row, group, unit) < split_cost(chunks, p_row, c_row, group, unit):
            chunks = grouped
    index = torch.tensor([k * unit + j for units in chunks for k in units for j in range(unit)],
                         device=batch.input_ids.device)
    starts = [0]
    for units in chunks:
        starts.append(starts[-1] + len(units) * unit)
    return [batch.select(index[a:b]).trim() for a, b in zip(starts, starts[1:])]


def _unit_groups(same_row: list[int], prompt_lens: list[int], comp_lens: list[int], unit: int
                 ) -> list[list[int]]:
    """Units in runs whose first row shares the previous unit's prompt, in batch order;
    the runs ordered longest-first by their longest unit (ties keep their order)."""
    groups: list[list[int]] = []
    for k in range(len(prompt_lens)):
        if k and same_row[k * unit]:
            groups[-1].append(k)
        else:
            groups.append([k])
    return sorted(groups, key=lambda g: -max(prompt_lens[k] + comp_lens[k] for k in g))


def _pack(groups: list[list[int]], prompt_lens: list[int], comp_lens: list[int], budget: int,
          unit: int) -> list[list[int]]:
    """Fill micro-batches of units, in the order given, while rows x (longest prompt +
    longest completion) stays within ``budget``; a group that does not fit the current
    micro-batch starts a new one, and is cut into consecutive pieces where it does not fit
    a micro-batch of its own."""
    chunks: list[list[int]] = []
    current: list[int] = []
    max_p = max_c = 0
    for units in groups:
        p = max(max_p, max(prompt_lens[k] for k in units))
        c = max(max_c, max(comp_lens[k] for k in units))
        if current and (len(current) + len(units)) * unit * (p + c) > budget:
            chunks.append(current)
            current, max_p, max_c = [], 0, 0
        for k in units:
            new_p, new_c = max(max_p, prompt_lens[k]), max(max_c, comp_lens[k])
            if current and (len(current) + 1) * unit * (new_p + new_c) > budget:
                chunks.append(current)
                current, new_p, new_c = [], prompt_lens[k], comp_lens[k]
            current.append(k)
            max_p, max_c = new_p, new_c
    chunks.append(current)
    return chunks


def split_cost(chunks: list[list[int]], p_row: list[int], c_row: list[int], group: list[int],
               unit: int) -> int:
    """Tokens a split of units computes: per micro-batch, rows x (longest prompt + longest
    completion), less (k - 1) x its longest prompt for each run of k adjacent rows of one
    prompt group (``group[row]``), whose prompt the shared-prompt forward runs once."""
    total = 0
    for units in chunks:
        rows = [k * unit + j for k in units for j in range(unit)]
        width_p = max(p_row[r] for r in rows)
        total += len(rows) * (width_p + max(c_row[r] for r in rows))
        total -= width_p * sum(group[a] == group[b] for a, b in zip(rows, rows[1:]))
    return total
