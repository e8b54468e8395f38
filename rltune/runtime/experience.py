"""From scored rollouts to a TrainBatch, and the rollout statistics of a step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rltune.algos import group_advantages
from rltune.data.collate import collate_rollouts
from rltune.data.records import Rollout, TrainBatch


def rewards_tensor(rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards [B], valid [B] bool)``; a missing reward is NaN and not valid."""
    rewards = torch.tensor(
        [r.reward if r.reward is not None else float("nan") for r in rollouts], dtype=torch.float32
    )
    return rewards, ~torch.isnan(rewards)


def grpo_experience(
    rollouts: Sequence[Rollout], *, group_size: int, adv_scale: str, pad_id: int
) -> TrainBatch:
    """Group-relative advantages (Shao et al. 2024) on one TrainBatch.

    Samples without a reward are excluded from their group's baseline and from the loss
    (their loss-mask is zeroed), never scored 0.
    """
    rewards, valid = rewards_tensor(rollouts)
    advantages = group_advantages(rewards, group_size, scale=adv_scale, valid=valid)
    batch = collate_rollouts(rollouts, pad_id)
    batch.loss_mask = batch.loss_mask * valid[:, None].float()
    batch.advantages = advantages[:, None].expand_as(batch.loss_mask)
    return batch


def rollout_metrics(rollouts: Sequence[Rollout], group_size: int) -> dict[str, float]:
    """Reward, length and group statistics of one step's rollouts."""
    rewards, valid = rewards_tensor(rollouts)
    lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)
    clipped = torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.float32)
    metrics = {
        "reward/mean": _mean(rewards[valid]),
        "reward/std": float(rewards[valid].std()) if int(valid.sum()) > 1 else 0.0,
        "reward/errors": float((~valid).sum()),
        "length/mean": float(lengths.mean()),
        "length/max": float(lengths.max()),
        "length/clipped_frac": float(clipped.mean()),
    }
    # spread over each group's valid rewards only (a missing one is NaN and would make the
    # whole group's max NaN); a group with under two valid rewards has no baseline, hence
    # zero advantages, and counts as zero-std
    grouped, ok = rewards.view(-1, group_size), valid.view(-1, group_size)
    top = torch.where(ok, grouped, -torch.inf).amax(1)
    bottom = torch.where(ok, grouped, torch.inf).amin(1)
    spread = torch.where(ok.sum(1) >= 2, top - bottom, 0.0)
    metrics["groups/zero_std_frac"] = float((spread == 0).float().mean())
    names = {name for r in rollouts for name in r.rewards}
    for name in sorted(names):
        values = torch.tensor(
            [v for r in rollouts if (v := r.rewards.get(name)) is not None], dtype=torch.float32
        )
        metrics[f"reward/{name}"] = _mean(values)
    return metrics


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else float("nan")
