"""Selective backprop in a learner group of two real processes (gloo, CPU): one rank's
rows all have zero advantage, so it runs only the one zero-gradient row the learner keeps
for it while the other rank runs its shard; with DDP and with FSDP2 the group's weights
after one and two steps equal those of one process on the whole batch without skipping.

Tolerances, as in tests/distributed/test_learner_group.py: fp32 throughout; the group's
gradient is the same sum taken in another order (and the skipped rows add exact zeros),
so components differ by fp32 rounding, ~1e-7 relative; with Adam's eps 1e-3 the update's
slope is at most lr / eps = 1, so the weights agree within 1e-6 after each step, while a
step moves them by ~1e-3.

The group takes ~25 s on a 2-core machine (slow); the one-process tests in
tests/unit/learner/test_learner_selective.py are the fast representatives.
"""

from __future__ import annotations

import copy

import pytest
import torch
from selective_workers import AGGREGATIONS, ZERO_ROWS, skip_batch, skip_learner, skipping_group_run, two_steps

from rltune.data.records import TrainBatch
from rltune.learner.launch import spawn_learner_group
from rltune.metrics import keys
from rltune.models.load import load_model

PARAM_ATOL = 1e-6
STRATEGIES = ("ddp", "fsdp2")


@pytest.fixture(scope="module")
def initial(model_dir: str) -> torch.nn.Module:
    return load_model(model_dir)


@pytest.fixture(scope="module")
def batch(initial: torch.nn.Module) -> TrainBatch:
    return skip_batch(initial)


@pytest.fixture(scope="module")
def single(initial: torch.nn.Module, batch: TrainBatch) -> dict:
    """One process, no skipping, two steps on the whole batch, per aggregation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {agg: two_steps(skip_learner(copy.deepcopy(initial), agg, False), batch) for agg in AGGREGATIONS}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def group(model_dir: str, batch: TrainBatch) -> list[dict]:
    return spawn_learner_group(2, skipping_group_run, model_dir, batch, backend="gloo", timeout_s=240)


@torch.no_grad()
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_one_rank_runs_only_its_kept_row(group: list[dict]) -> None:
    """Rank 1 skipped all four rows but one; rank 0 runs more micro-batches, so DDP's
    ranks sync on different forwards and FSDP2 pads rank 1 with forwards."""
    assert group[1]["micro_batches"] == 1
    assert group[0]["micro_batches"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_skipping_group_steps_as_one_process_on_the_whole_batch(
    strategy: str, aggregation: str, initial: torch.nn.Module, single: dict, group: list[dict], batch: TrainBatch,
) -> None:
    start = {k: v.detach() for k, v in initial.state_dict().items()}
    expected = single[aggregation]
    for step in range(2):
        ranks = [g[f"{strategy}/{aggregation}"] for g in group]
        assert max_abs_diff(expected["weights"][step], start) > 100 * PARAM_ATOL  # the step moved the weights
        assert max_abs_diff(ranks[0]["weights"][step], expected["weights"][step]) <= PARAM_ATOL, step
        assert max_abs_diff(ranks[0]["weights"][step], ranks[1]["weights"][step]) == 0.0
        metrics = [r["metrics"][step] for r in ranks]
        assert metrics[0] == metrics[1]  # the group's metrics on every rank
        empty = int((batch.loss_mask.sum(1) == 0).logical_and(batch.advantages[:, 0] != 0).sum())
        # the share of the group's rows not run: the zeroed ones and those that train no
        # token, less the one row rank 1 keeps
        assert metrics[0][keys.LEARN_SKIPPED_FRAC] == (len(ZERO_ROWS) + empty - 1) / len(batch)
        assert metrics[0]["loss"] == pytest.approx(expected["metrics"][step]["loss"], rel=1e-5, abs=1e-7)
        assert metrics[0]["grad_norm"] == pytest.approx(expected["metrics"][step]["grad_norm"], rel=1e-5)
