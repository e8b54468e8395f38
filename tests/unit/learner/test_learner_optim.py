"""Learning-rate schedule: hand values of lr_factor and the lr the learner reports."""

from __future__ import annotations

import copy

import pytest
import torch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.learner.optim import build_optimizer, lr_factor
from rltune.metrics.types import scalars


def test_warmup_then_constant() -> None:
    f = [lr_factor(s, warmup=2, total=10, schedule="constant", min_ratio=0.0) for s in range(12)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0], abs=1e-12)
    assert f[3:] == [1.0] * 9


def test_no_warmup_starts_at_peak() -> None:
    assert lr_factor(0, warmup=0, total=10, schedule="constant", min_ratio=0.0) == 1.0
    assert lr_factor(0, warmup=0, total=10, schedule="cosine", min_ratio=0.0) == 1.0


@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_warmup_then_cosine(min_ratio: float) -> None:
    def f(step: int) -> float:
        return lr_factor(step, warmup=2, total=10, schedule="cosine", min_ratio=min_ratio)

    assert [f(0), f(1), f(2)] == pytest.approx([1 / 3, 2 / 3, 1.0], abs=1e-12)
    # decay spans steps 2..10 (8 steps); its midpoint is step 6, a quarter of it step 4
    assert f(6) == pytest.approx((1 + min_ratio) / 2, abs=1e-12)
    quarter = 0.5 * (1 + 2**-0.5)  # (1 + cos(pi/4)) / 2
    assert f(4) == pytest.approx(min_ratio + (1 - min_ratio) * quarter, abs=1e-12)
    assert f(10) == pytest.approx(min_ratio, abs=1e-12)
    assert f(25) == pytest.approx(min_ratio, abs=1e-12)  # held at the floor past the end


def test_optimizer_rejects_a_frozen_model() -> None:
    layer = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(layer.parameters(), TrainConfig())


def test_learner_reports_and_uses_the_scheduled_lr() -> None:
    """A skipped (non-finite) step does not advance the schedule."""
    torch.manual_seed(0)

    class Unigram(torch.nn.Module):
        """A stand-in LM: next-token logits that ignore the context."""

        def __init__(self) -> None:
            super().__init__()
            self.logits = torch.nn.Parameter(torch.zeros(5))

        def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep):
            return type("Out", (), {"logits": self.logits.expand(input_ids.shape[0], logits_to_keep, 5)})

    cfg = TrainConfig(lr=1e-2, warmup_steps=2, steps=10, schedule="cosine", grad_clip=None)
    learner = LocalLearner(Unigram(), build_objective(ALGORITHMS["sft"], AlgoConfig(name="sft")), cfg)
    batch = TrainBatch(
        input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
        prompt_len=1, loss_mask=torch.ones(1, 2),
    )
    bad = copy.copy(batch)
    bad.loss_mask = torch.tensor([[1.0, float("inf")]])
    lrs = [scalars(learner.step(batch))["lr"], scalars(learner.step(batch))["lr"]]
    assert scalars(learner.step(bad))["skipped"] == 1.0
    lrs += [scalars(learner.step(batch))["lr"] for _ in range(5)]
    expected = [1e-2 * lr_factor(s, warmup=2, total=10, schedule="cosine", min_ratio=0.0) for s in range(8)]
    assert lrs == pytest.approx(expected[:7], rel=1e-12)
    # seven applied steps: the optimizer now holds the lr of step 7
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(expected[7], rel=1e-12)
    assert learner.version == 7
