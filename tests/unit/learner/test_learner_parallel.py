"""The learner's seam to its parallelism strategy, in one process: what the learner asks
the strategy in a step, and that the forwards a lockstep strategy (FSDP2) adds to match a
busier rank change nothing (checked bitwise: they add exact zeros to the gradients).

The strategies over a real process group are checked in
tests/distributed/test_learner_group.py."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_learner_step import budget_for, grpo_batch

from rltune.algos import ALGORITHMS
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import build_objective
from rltune.learner.parallel import NoParallelism, StepPlan, make_parallelism
from rltune.metrics.types import scalars


class Recording(NoParallelism):
    """One process, recording what the learner asks; ``extra`` forwards are added to
    each plan, as a rank with fewer micro-batches than the busiest gets from FSDP2."""

    def __init__(self, extra: int = 0) -> None:
        super().__init__()
        self.extra = extra
        self.calls: list[tuple] = []

    def agree(self, rows: int, forwards: int, denominator: torch.Tensor | None) -> StepPlan:
        self.calls.append(("agree", rows, forwards, denominator is not None))
        plan = super().agree(rows, forwards, denominator)
        return replace(plan, forwards=plan.forwards + self.extra)

    def gradient_sync(self, module: torch.nn.Module, sync: bool):
        self.calls.append(("sync", sync))
        return super().gradient_sync(module, sync)


def learner(model: torch.nn.Module, budget: int, parallelism=None) -> LocalLearner:
    objective = build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo"))
    cfg = TrainConfig(lr=1e-3, grad_clip=None, micro_batch_tokens=budget)
    return LocalLearner(copy.deepcopy(model), objective, cfg, parallelism=parallelism)


@pytest.fixture(scope="module")
def batch(tiny_model: torch.nn.Module) -> TrainBatch:
    return grpo_batch(tiny_model)


def test_one_agreement_per_step_and_one_gradient_exchange(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    recording = Recording()
    learner(tiny_model, budget_for(batch, 3), recording).step(batch)
    assert recording.calls == [("agree", 8, 3, True), ("sync", False), ("sync", False), ("sync", True)]


def test_padding_forwards_change_nothing(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    """Two extra forwards on padding rows: the same weights, metrics and log-probs, to
    the bit; the exchange moves to the last (padding) forward."""
    budget = budget_for(batch, 3)
    plain, padded = learner(tiny_model, budget), learner(tiny_model, budget, Recording(extra=2))
    metrics = [scalars(plain.step(batch)), scalars(padded.step(batch))]
    assert metrics[0] == metrics[1]
    assert [c for c in padded.parallelism.calls if c[0] == "sync"] == [("sync", False)] * 4 + [("sync", True)]
    for name, value in plain.export_weights().items():
        assert torch.equal(padded.export_weights()[name], value), name
    assert torch.equal(padded.logprobs(batch), plain.logprobs(batch))
    # the prediction: chunks of budget // width rows (72 // 24 = 3 of the 8 rows): 3 forwards
    assert budget // batch.input_ids.shape[1] == 3
    assert padded.parallelism.calls[-1] == ("agree", 8, 3, False)


def test_an_empty_batch_is_refused(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    with pytest.raises(ValueError, match="the learner received a batch with no rows"):
        learner(tiny_model, 1000).step(batch.select(slice(0, 0)))


def test_none_is_the_default_strategy() -> None:
    assert isinstance(make_parallelism("none"), NoParallelism)
