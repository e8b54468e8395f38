"""Selective backprop (``algo.skip_zero_advantage``): which rows the learner leaves out,
that the update is the full batch's with every aggregation, and which configurations are
refused because it would not be."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fp32_bounds as fp32
from test_learner_step import ADAM_EPS, LR, Whole, budget_for, grpo_batch

from rltune.algos import ALGORITHMS, config_problems
from rltune.config import ConfigError
from rltune.config.schema import AlgoConfig, TrainConfig
from rltune.data.records import TrainBatch
from rltune.learner.learner import LocalLearner
from rltune.learner.objectives import Objective, build_objective
from rltune.learner.selective import select_rows, trained_rows
from rltune.metrics import keys
from rltune.metrics.types import scalars

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MAX_LEN = 16  # the constant of seq-mean-token-sum-norm; the batch's completions are shorter
ZERO_ROWS = [0, 1, 2, 3, 6]  # a group of four with no reward spread, and one more sample


def zeroed(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    advantages = batch.advantages.clone()
    advantages[rows] = 0.0
    return dataclasses.replace(batch, advantages=advantages)


@pytest.fixture(scope="module")
def batch(tiny_model: torch.nn.Module) -> TrainBatch:
    return zeroed(grpo_batch(tiny_model), ZERO_ROWS)


def objective_for(aggregation: str) -> Objective:
    return build_objective(ALGORITHMS["grpo"], AlgoConfig(name="grpo", aggregation=aggregation), max_len=MAX_LEN)


def skipping_step(model: torch.nn.Module, batch: TrainBatch, objective: Objective, budget: int,
                  grad_clip: float | None) -> tuple[torch.nn.Module, dict, dict[str, torch.Tensor]]:
    """One step with ``skip_zero_advantage`` on a copy of ``model``: the copy, the metrics
    and the step's gradients before clipping (as ``test_learner_step.run_split``)."""
    copy_ = copy.deepcopy(model)
    cfg = TrainConfig(lr=LR, micro_batch_tokens=budget, grad_clip=grad_clip)
    learner = LocalLearner(copy_, objective, cfg, skip_zero_advantage=True)
    for group in learner.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    grads = fp32.capture_grads(copy_)
    return copy_, scalars(learner.step(batch)), grads


# ---------------------------------------------------------------- which rows


def test_rows_with_an_advantage_on_a_trained_token_are_kept() -> None:
    loss_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    advantages = torch.tensor([[0.0, 0.0], [0.0, 2.0], [1.0, 1.0], [0.5, 0.5], [float("nan")] * 2])
    batch = TrainBatch(input_ids=torch.ones(5, 3, dtype=torch.long), attention_mask=torch.ones(5, 3, dtype=torch.long),
                       prompt_len=1, loss_mask=loss_mask, advantages=advantages)
    # row 1's advantage is on a masked-out token, row 2 trains no token; a NaN is kept
    # so that the non-finite guard still sees it
    assert trained_rows(batch).tolist() == [False, False, False, True, True]
    selection = select_rows(batch)
    assert (selection.skipped, selection.total, len(selection.rows)) == (3, 5, 2)
    assert torch.equal(selection.rows.advantages[:1], advantages[3:4])
    assert scalars(selection.metrics()) == {keys.LEARN_SKIPPED_FRAC: 0.6}
    # units of two rows travel together: a pair is kept when either row has an advantage
    assert trained_rows(dataclasses.replace(batch, advantages=advantages[:4], loss_mask=loss_mask[:4],
                                            input_ids=batch.input_ids[:4], attention_mask=batch.attention_mask[:4]),
                        unit=2).tolist() == [False, True]


def test_a_batch_without_any_advantage_keeps_its_first_row() -> None:
    batch = TrainBatch(input_ids=torch.ones(3, 3, dtype=torch.long), attention_mask=torch.ones(3, 3, dtype=torch.long),
                       prompt_len=1, loss_mask=torch.ones(3, 2), advantages=torch.zeros(3, 2))
    selection = select_rows(batch)
    assert (selection.skipped, len(selection.rows)) == (2, 1)
    with pytest.raises(ValueError, match="without advantages"):
        select_rows(dataclasses.replace(batch, advantages=None))


# ---------------------------------------------------------------- the update


# Tolerances from fp32_bounds.py, as for the micro-batch invariance tests: a skipped row
# adds exactly zero (its loss terms are -0 * r), so the two steps differ only in the
# shapes the kernels see (the kept rows are trimmed of columns only skipped rows used),
# which reorders fp32 sums over at most the whole batch's N positions: gradients within
# 4 N u A per entry, parameters (AdamW eps 1e-3, lr 1e-3: slope lr / eps = 1) within that
# plus the update's roundings. The 1e-6 is checked besides, in absolute terms.
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_skipping_gives_the_full_batch_update(tiny_model: torch.nn.Module, batch: TrainBatch,
                                             aggregation: str, chunks: int) -> None:
    objective = objective_for(aggregation)
    whole = Whole(tiny_model, batch, "grpo", aggregation, None, objective)
    budget = budget_for(batch, chunks)
    model, metrics, grads = skipping_step(tiny_model, batch, objective, budget, None)
    whole.assert_same_update(model, metrics, grads)
    for name, p in model.named_parameters():
        assert float((p.detach() - dict(whole.model.named_parameters())[name].detach()).abs().max()) <= 1e-6, name
    # the zeroed rows, and those with nothing in their loss mask (they train no token)
    skipped = set(ZERO_ROWS) | set((batch.loss_mask.sum(1) == 0).nonzero().flatten().tolist())
    assert metrics[keys.LEARN_SKIPPED_FRAC] == len(skipped) / len(batch)
    assert metrics["tokens"] == whole.metrics["tokens"] == float(batch.loss_mask.sum())


def test_skipping_with_the_clip_active(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    objective = objective_for("token-mean")
    whole = Whole(tiny_model, batch, "grpo", "token-mean", 0.05, objective)
    assert whole.metrics["grad_norm"] > 10 * 0.05
    whole.assert_same_update(*skipping_step(tiny_model, batch, objective, budget_for(batch, 2), 0.05))


def test_the_check_tells_a_denominator_of_the_kept_rows_apart(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    """Control: the mistake selective backprop must not make (dividing by the rows that
    run rather than the whole batch's) moves the update by many times the tolerance."""
    objective = objective_for("seq-mean-token-mean")
    whole = Whole(tiny_model, batch, "grpo", "seq-mean-token-mean", None, objective)
    kept = select_rows(batch).rows
    model, metrics, grads = skipping_step(tiny_model, kept, objective, 10_000, None)
    assert fp32.worst_excess(grads, whole.grads, whole.grad_tol)[0] > 100
    with pytest.raises(AssertionError, match="times the derived tolerance"):
        whole.assert_same_update(model, metrics, grads)


def test_an_all_zero_batch_still_steps_as_the_full_batch(tiny_model: torch.nn.Module, batch: TrainBatch) -> None:
    """With every advantage zero the gradient is zero, but AdamW still moves the weights by
    its momentum: the skipping learner must give it zero gradients (not none) to match."""
    cfg = TrainConfig(lr=LR, grad_clip=None, weight_decay=0.1)
    full = LocalLearner(copy.deepcopy(tiny_model), objective_for("token-mean"), cfg)
    full.step(batch)  # a first step gives AdamW momentum
    skip = copy.deepcopy(full)  # the same weights and moments, to the bit
    skip.skip_zero_advantage = True
    nothing = zeroed(batch, list(range(len(batch))))
    before = {n: p.detach().clone() for n, p in skip.model.named_parameters()}
    assert scalars(full.step(nothing))["grad_norm"] == 0.0
    metrics = scalars(skip.step(nothing))
    assert metrics[keys.LEARN_SKIPPED_FRAC] == (len(batch) - 1) / len(batch)
    assert skip.version == full.version == 2
    for (name, p), q in zip(skip.model.named_parameters(), full.model.parameters()):
        assert torch.equal(p, q), name  # both steps saw exact zeros: the same arithmetic
        assert not torch.equal(p, before[name]), name  # and the momentum moved every weight


# ---------------------------------------------------------------- what is refused


def registry_problems(*overrides: str) -> list[str]:
    from rltune.config import load_config

    cfg = load_config(None, ["reward=[{fn: builtin:exact_numeric}]", "algo.skip_zero_advantage=true", *overrides])
    return config_problems(ALGORITHMS[cfg.algo.name], cfg)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["algo.name=sft"], "sft learns from a fixed dataset without advantages"),
    (["algo.name=dpo"], "dpo learns from a fixed dataset without advantages"),
    (["algo.name=grpo", "algo.kl_coef=0.1"], "a sample with zero advantage still has a KL gradient"),
    (["algo.name=grpo", "model.router_aux_loss_coef=0.01"], "router_aux_loss_coef: 0"),
    (["algo.name=grpo", "model.moe.aux_free_bias=0.001"], "set aux_free_bias: 0"),
])
def test_combinations_that_would_change_the_update_are_refused(overrides: list[str], expected: str) -> None:
    found = registry_problems(*overrides)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("overrides", [
    ["algo.name=grpo"], ["algo.name=dapo", "algo.dynamic_sampling=true"], ["algo.name=gspo"],
    ["algo.name=ppo", "algo.kl_coef=0.05", "algo.kl_in_reward=true"],
    ["algo.name=grpo", "algo.importance_correction=token-truncate"],
])
def test_exact_combinations_are_accepted(overrides: list[str]) -> None:
    assert registry_problems(*overrides) == []


def test_an_moe_model_with_its_own_router_loss_is_refused(tiny_moe_model: torch.nn.Module) -> None:
    with pytest.raises(ConfigError, match="router_aux_loss_coef: 0"):
        LocalLearner(tiny_moe_model, objective_for("token-mean"), TrainConfig(), aux_loss_coef=0.01,
                     skip_zero_advantage=True)
