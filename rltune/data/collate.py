"""Turning records into padded batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from rltune.data.records import Prompt, Rollout, TrainBatch, VisionInputs


def left_pad(seqs: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D long tensors right-aligned: ``(ids [R, P], attention_mask [R, P])``."""
    ids = pad_sequence(list(seqs), batch_first=True, padding_value=pad_id, padding_side="left")
    lengths = torch.tensor([len(s) for s in seqs])
    mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - lengths[:, None]).long()
    return ids, mask


def right_pad(seqs: Sequence[torch.Tensor], value: float | int) -> torch.Tensor:
    return pad_sequence(list(seqs), batch_first=True, padding_value=value)


def join(
    prompt_ids: Sequence[torch.Tensor], completion_ids: Sequence[torch.Tensor], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts then right-padded completions: ``(input_ids [B, T],
    attention_mask [B, T], prompt_len)``."""
    p_ids, p_mask = left_pad(prompt_ids, pad_id)
    c_ids = right_pad(completion_ids, pad_id)
    lengths = torch.tensor([len(c) for c in completion_ids])
    c_mask = (torch.arange(c_ids.shape[1]) < lengths[:, None]).long()
    return torch.cat([p_ids, c_ids], dim=1), torch.cat([p_mask, c_mask], dim=1), p_ids.shape[1]


def collate_rollouts(rollouts: Sequence[Rollout], pad_id: int) -> TrainBatch:
    """A TrainBatch of rollouts, without advantages. ``behaviour_logprobs`` are the
    engine's log-probs when every rollout has them."""
    input_ids, attention_mask, prompt_len = join(
        [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id
    )
    have_logprobs = all(r.completion_logprobs is not None for r in rollouts)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=prompt_len,
        loss_mask=right_pad([r.loss_mask for r in rollouts], 0.0),
        behaviour_logprobs=(
            right_pad([r.completion_logprobs for r in rollouts], 0.0) if have_logprobs else None
        ),
        versions=torch.tensor([r.policy_version for r in rollouts]),
        routes=collate_routes(rollouts, prompt_len),
        vision=row_vision([r.vision for r in rollouts]),
    )


def row_vision(per_row: Sequence[VisionInputs | None]) -> list[VisionInputs | None] | None:
    """``TrainBatch.vision`` from each row's pixel inputs: the list, or None when no row
    has images."""
    return list(per_row) if any(v is not None for v in per_row) else None


def collate_routes(rollouts: Sequence[Rollout], prompt_len: int) -> torch.Tensor | None:
    """The rollouts' recorded MoE routes as ``[B, T, L, k]``, laid out like ``input_ids``
    (prompt part left-padded to ``prompt_len``, completion part right-padded), -1 on
    padding; None when no rollout has routes. Some with and some without is an error: the
    learner would replay the routes of some samples only."""
    have = [r.routes is not None for r in rollouts]
    if not any(have):
        return None
    if not all(have):
        missing = [r.prompt_id for r in rollouts if r.routes is None][:3]
        raise ValueError(
            f"{have.count(False)} of {len(rollouts)} rollouts carry no MoE routes (prompts "
            f"{missing}...) while the others do; routing replay needs every sample's routes"
        )
    for r in rollouts:
        if len(r.routes) != len(r.prompt_ids) + len(r.completion_ids):
            raise ValueError(
                f"rollout of prompt {r.prompt_id!r}: routes cover {len(r.routes)} tokens, its prompt "
                f"and completion {len(r.prompt_ids)} + {len(r.completion_ids)}"
            )
    prompts = [r.routes[: len(r.prompt_ids)] for r in rollouts]
    completions = [r.routes[len(r.prompt_ids):] for r in rollouts]
    left = pad_sequence(prompts, batch_first=True, padding_value=-1, padding_side="left")
    right = pad_sequence(completions, batch_first=True, padding_value=-1)
    if left.shape[1] != prompt_len:
        raise ValueError(f"routes cover {left.shape[1]} prompt columns, the batch has {prompt_len}")
    return torch.cat([left, right], dim=1)


def collate_sft(prompts: Sequence[Prompt], pad_id: int) -> TrainBatch:
    """A TrainBatch of (prompt, target completion) pairs; the loss covers the completion
    (``meta["completion_ids"]``, EOS included) and nothing of the prompt."""
    completions = [torch.tensor(p.meta["completion_ids"], dtype=torch.long) for p in prompts]
    input_ids, attention_mask, prompt_len = join(
        [torch.tensor(p.input_ids, dtype=torch.long) for p in prompts], completions, pad_id
    )
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=prompt_len,
        loss_mask=attention_mask[:, prompt_len:].float(),
        vision=row_vision([p.vision for p in prompts]),
    )


def collate_pairs(
    prompts: Sequence[Prompt], pad_id: int, ref_logps: torch.Tensor | None = None
) -> TrainBatch:
    """A TrainBatch of preference pairs, two rows per prompt, interleaved
    ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``: both rows of a pair hold the
    same prompt ids, then ``meta["chosen_ids"]`` or ``meta["rejected_ids"]`` (EOS
    included). The loss mask covers the completion tokens.

    ``ref_logps`` ``[len(prompts), 2]`` (the reference model's summed log-probs of each
    prompt's chosen and rejected completion, in that order) becomes ``ref_seq_logps``
    ``[2 * len(prompts)]`` in the same interleaved order; None leaves it unset.
    """
    if not prompts:
        raise ValueError("collate_pairs: no prompts")
    if ref_logps is not None and tuple(ref_logps.shape) != (len(prompts), 2):
        raise ValueError(
            f"collate_pairs: ref_logps has shape {tuple(ref_logps.shape)}, expected "
            f"({len(prompts)}, 2): one (chosen, rejected) pair per prompt"
        )
    prompt_ids, completions = [], []
    for p in prompts:
        if "chosen_ids" not in p.meta or "rejected_ids" not in p.meta:
            raise ValueError(
                f"collate_pairs: prompt {p.id!r} has no chosen_ids / rejected_ids in its meta; "
                f"load preference data with load_prompts(..., with_pairs=True)"
            )
        ids = torch.tensor(p.input_ids, dtype=torch.long)
        prompt_ids += [ids, ids]
        completions += [
            torch.tensor(p.meta["chosen_ids"], dtype=torch.long),
            torch.tensor(p.meta["rejected_ids"], dtype=torch.long),
        ]
    input_ids, attention_mask, prompt_len = join(prompt_ids, completions, pad_id)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=prompt_len,
        loss_mask=attention_mask[:, prompt_len:].float(),
        ref_seq_logps=None if ref_logps is None else ref_logps.float().reshape(-1),
        vision=row_vision([p.vision for p in prompts for _ in range(2)]),
    )
