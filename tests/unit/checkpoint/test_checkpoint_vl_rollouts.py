"""Queued vision-language rollouts survive a checkpoint: their images and pixel inputs are
their prompt's objects again after loading (not copies, not saved twice), and a run whose
prompt has other images is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rltune.checkpoint.rollouts import QueuedBatch, batches_from_state, batches_to_state
from rltune.checkpoint.store import CheckpointError, load_checkpoint, save_checkpoint
from rltune.data.records import Prompt, PromptImage, Rollout


def _prompt(name: str, digest: str, patches: int) -> Prompt:
    vision = {"pixel_values": torch.rand(patches, 6), "image_grid_thw": torch.tensor([[1, 2, patches // 2]])}
    image = PromptImage(source=f"{name}.png", digest=digest, data=b"\x89PNG" + digest.encode())
    return Prompt(id=name, text="<image>how many?", input_ids=[1, 2, 3], images=[image], vision=vision)


def _rollout(prompt: Prompt, group: int) -> Rollout:
    return Rollout(prompt_id=prompt.id, group=group, prompt_ids=torch.tensor(prompt.input_ids),
                   completion_ids=torch.tensor([5, 6]), completion_logprobs=torch.tensor([-0.5, -0.25]),
                   loss_mask=torch.ones(2), text="2", finish_reason="stop", policy_version=1,
                   images=prompt.images, vision=prompt.vision)


def _saved(tmp_path: Path, prompts: list[Prompt]) -> tuple[dict, list]:
    batch = QueuedBatch(prompts[:2], [_rollout(prompts[0], 0), _rollout(prompts[0], 0), _rollout(prompts[1], 1)],
                        {}, version=1)
    tensors, meta = batches_to_state([batch], prompts)
    path = save_checkpoint(tmp_path, 1, tensors={"queue": tensors}, meta={"queue": meta}, keep=1)
    tensors, meta = load_checkpoint(path)
    return tensors["queue"], meta["queue"]


def test_rollouts_get_their_prompts_images_and_pixel_inputs_back(tmp_path: Path) -> None:
    prompts = [_prompt("a", "aa11", 4), _prompt("b", "bb22", 8), Prompt(id="c", text="1+1=", input_ids=[4])]
    tensors, meta = _saved(tmp_path, prompts)
    assert not any("vision" in name or "images" in name for name in tensors)  # not saved twice
    # the resumed run's data loader renders the prompts afresh: other objects, same images
    fresh = [_prompt("a", "aa11", 4), _prompt("b", "bb22", 8), prompts[2]]
    (batch,) = batches_from_state(tensors, meta, fresh, where="ckpt")
    got = [(r.prompt_id, r.images is fresh["ab".index(r.prompt_id)].images,
            r.vision is fresh["ab".index(r.prompt_id)].vision) for r in batch.rollouts]
    assert got == [("a", True, True), ("a", True, True), ("b", True, True)]


def test_a_prompt_with_other_images_is_refused(tmp_path: Path) -> None:
    prompts = [_prompt("a", "aa11", 4), _prompt("b", "bb22", 8)]
    tensors, meta = _saved(tmp_path, prompts)
    other = [_prompt("a", "aa11", 4), _prompt("b", "cc33", 8)]
    with pytest.raises(CheckpointError, match=r"prompt 'b' with images \['bb22'\].*\['cc33'\]; resume with the same data"):
        batches_from_state(tensors, meta, other, where="ckpt")
