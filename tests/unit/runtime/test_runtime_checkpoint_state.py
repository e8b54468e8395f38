"""A learner rank's one-file checkpoint state (``rank_checkpoint_state``) is a snapshot:
the learner's later steps do not change it. On a CPU, state dicts hand out the live
tensors (``Tensor.cpu()`` of a CPU tensor is the tensor itself), so without a copy a state
kept while the learner steps on would hold the later weights, moments and Adam ``step``."""

from __future__ import annotations

import torch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.collate import join
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.models.load import load_model
from rltune.runtime.ray.fsdp_state import rank_checkpoint_state


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 260, (n,), generator=g) for n in (3, 5)]
    comps = [torch.randint(4, 260, (n,), generator=g) for n in (4, 2)]
    input_ids, attention_mask, prompt_len = join(prompts, comps, 0)
    mask = attention_mask[:, prompt_len:].float()
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, prompt_len=prompt_len,
                      loss_mask=mask, advantages=torch.tensor([[1.0], [-1.0]]).expand_as(mask))


def flat(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {k: v for key, item in items for k, v in flat(item, f"{prefix}/{key}").items()}


def test_the_state_is_not_changed_by_the_next_step(tiny_path: str, one_thread: None) -> None:
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    learner = LocalLearner(load_model(tiny_path), objective, TrainConfig(lr=1e-3))
    learner.step(batch())  # the optimizer has its moments and step counters now
    state = rank_checkpoint_state(learner, "none", "", None)
    assert state is not None
    tensors = flat(state)
    assert any(key.endswith(".step") for key in tensors)  # Adam's counters are in it
    before = {k: v.clone() for k, v in tensors.items()}
    learner.step(batch())
    changed = [k for k in tensors if not torch.equal(tensors[k], before[k])]
    assert changed == []
    # the control: the learner's own tensors did move
    moved = flat(rank_checkpoint_state(learner, "none", "", None))
    assert sum(not torch.equal(moved[k], before[k]) for k in before) > len(before) // 2
