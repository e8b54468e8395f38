"""Batches generated ahead of the learner survive a checkpoint on disk (safetensors + JSON)
field for field: every rollout field with its value and dtype, the prompts, the
producer's metrics with their reductions, the policy version; and a checkpoint that does
not fit the run's data is refused with a message naming it."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from rltune.checkpoint.rollouts import QueuedBatch, batches_from_state, batches_to_state
from rltune.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint
from rltune.data.records import Prompt, Rollout
from rltune.metrics.types import Aggregator, Histogram, Last, Max, Mean, Min, Sum

PROMPTS = [Prompt(id=f"p{i}", text=f"{i}+1=", meta={"answer": str(i + 1)}) for i in range(5)]


def _rollout(prompt: Prompt, group: int, length: int, **extra) -> Rollout:
    return Rollout(
        prompt_id=prompt.id, group=group,
        prompt_ids=torch.tensor([7, 8, 9][: 1 + group], dtype=torch.long),
        completion_ids=torch.arange(length, dtype=torch.long) + 100,
        completion_logprobs=-torch.rand(length, dtype=torch.float32) / 3,  # not exact in decimal
        loss_mask=torch.ones(length, dtype=torch.float32), text=f"completion {group}",
        finish_reason="stop", policy_version=3, reward=0.1 + group / 7, rewards={"digits": 0.1 + group / 7},
        **extra,
    )


def _batches() -> list[QueuedBatch]:
    p3, p1, p4 = PROMPTS[3], PROMPTS[1], PROMPTS[4]
    turns = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"}]
    first = [
        _rollout(p3, 0, 4),
        _rollout(p3, 0, 0, reward_error="ValueError: not a number"),  # empty completion
        _rollout(p1, 1, 3, turns=turns, env_reward=0.5),
    ]
    first[1].reward, first[1].rewards = None, {"digits": None}
    first[2].completion_logprobs = None  # an engine that reports none
    first[2].loss_mask = torch.tensor([1.0, 0.0, 1.0])  # a tool token
    second = [_rollout(p4, 0, 2, dropped=True, env_error="timed out")]
    second[0].reward = math.nan
    metrics = Aggregator().add({"reward/mean": 0.25, "reward/errors": Sum(1.0), "length/max": Max(4.0),
                                "length/min": Min(0.0), "lr": Last(1e-3), "lengths": Histogram([4.0, 0.0, 3.0])},
                               weight=3.0).result()
    return [QueuedBatch([p3, p1], first, {**metrics, "time/generate": 0.125}, version=3),
            QueuedBatch([p4], second, {}, version=4)]


def _same(a: Rollout, b: Rollout) -> None:
    for f in fields(Rollout):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, float) and math.isnan(x):
            assert math.isnan(y), f.name
        else:
            assert x == y, f.name


def test_queued_batches_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    batches = _batches()
    tensors, meta = batches_to_state(batches, PROMPTS)
    path = save_checkpoint(tmp_path, 2, tensors={"queue": tensors}, meta={"queue": meta}, keep=1)
    loaded_tensors, loaded_meta = load_checkpoint(path)
    back = batches_from_state(loaded_tensors["queue"], loaded_meta["queue"], PROMPTS, where=str(path))
    assert len(back) == 2
    for saved, restored in zip(batches, back):
        assert restored.version == saved.version
        assert all(a is b for a, b in zip(restored.prompts, saved.prompts))  # the run's own prompt objects
        assert len(restored.rollouts) == len(saved.rollouts)
        for a, b in zip(saved.rollouts, restored.rollouts):
            _same(a, b)
    restored = back[0].metrics
    assert restored["reward/mean"] == Mean(0.25, 3.0) and restored["reward/errors"] == Sum(1.0)
    assert restored["length/max"] == Max(4.0) and restored["length/min"] == Min(0.0)
    assert restored["lr"] == Last(1e-3) and restored["lengths"] == Histogram([4.0, 0.0, 3.0])
    assert restored["time/generate"] == Mean(0.125, 1.0)  # a plain number: a mean of weight 1
    # one tensor per batch and field, not one per rollout
    assert sorted(tensors) == ["0.completion_ids", "0.completion_logprobs", "0.loss_mask", "0.prompt_ids",
                               "1.completion_ids", "1.completion_logprobs", "1.loss_mask", "1.prompt_ids"]


def test_an_empty_queue_round_trips(tmp_path: Path) -> None:
    tensors, meta = batches_to_state([], PROMPTS)
    assert tensors == {} and meta == []
    assert batches_from_state({}, [], PROMPTS, where="x") == []


def test_a_queue_saved_against_other_data_is_refused() -> None:
    tensors, meta = batches_to_state(_batches(), PROMPTS)
    other = [Prompt(id=f"q{i}", text="x") for i in range(5)]
    with pytest.raises(CheckpointError, match=r"ckpt: .*prompt 'p3' \(row 3\).*same data"):
        batches_from_state(tensors, meta, other, where="ckpt")
    with pytest.raises(CheckpointError, match="ckpt: queued batch 0 lacks the values of rollout 0's completion_ids"):
        batches_from_state({k: v for k, v in tensors.items() if k != "0.completion_ids"}, meta, PROMPTS, where="ckpt")


def test_only_the_runs_own_prompts_are_saved() -> None:
    stray = QueuedBatch([Prompt(id="p0", text="0+1=")], [], {}, version=0)  # equal, but not the run's object
    with pytest.raises(ValueError, match="prompt 'p0' is not one of the run's train prompts"):
        batches_to_state([stray], PROMPTS)
