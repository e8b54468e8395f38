"""A learner group of two real processes (gloo, CPU) trains the built-in tiny model as one
LocalLearner does on the whole batch, with DDP and with FSDP2: same weights after one and
after two optimizer steps, same metrics on every rank, same log-probs.

Tolerances. Everything runs in fp32. The group's gradient is the same sum as one
process's, taken in another order (each rank accumulates its own micro-batches, then the
two ranks' sums are added), so gradient components differ by fp32 rounding, ~1e-7
relative. Adam divides by ``sqrt(v) + eps``; with the default eps=1e-8 its slope near a
zero gradient is lr/eps = 1e5 and would turn that rounding into ~1e-5 parameter
differences (see tests/unit/learner/test_learner_step.py). The two-step comparisons use
eps=1e-3 (slope <= lr/eps = 1), so parameters agree within PARAM_ATOL = 1e-6 after each
step (measured: below 1e-7), while a step moves them by ~1e-3 and the control below
(local denominators) differs by ~1e-4. Metrics are means and sums of the same fp32
numbers in another order: rel 1e-5.

The default eps=1e-8 is compared on the first step, entry by entry, against the bound
that tests/unit/learner/fp32_bounds.py derives: gradients of two fp32 computations within
``4 N u A``, and the first Adam step's slope where the gradient is
(``small_eps_update_tolerance``); the same bound refuses the control.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from learner_group_workers import (
    BUDGET,
    DEFAULT_EPS,
    GRAD_CLIP,
    LR,
    fail_on_rank_one,
    group_run,
    make_batch,
    make_learner,
    train_two_steps,
)

from rltune.data.records import TrainBatch
from rltune.data.shards import shard_bounds
from rltune.learner.distributed import init_group, shard_batch
from rltune.learner.launch import spawn_learner_group
from rltune.learner.microbatch import split_by_tokens
from rltune.learner.parallel import make_parallelism
from rltune.models.load import load_model

# the fp32 bounds of the learner's unit tests (this directory is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "learner"))
import fp32_bounds as fp32  # noqa: E402

PARAM_ATOL = 1e-6
STRATEGIES = ("ddp", "fsdp2")


@pytest.fixture(scope="module")
def initial(model_dir: str) -> torch.nn.Module:
    return load_model(model_dir)


@pytest.fixture(scope="module")
def batch(initial: torch.nn.Module) -> TrainBatch:
    return make_batch(initial)


@pytest.fixture(scope="module")
def single(initial: torch.nn.Module, batch: TrainBatch) -> dict:
    """One LocalLearner, two steps on the whole batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_two_steps(make_learner(copy.deepcopy(initial)), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_eps_bound(initial: torch.nn.Module, batch: TrainBatch) -> dict:
    """One LocalLearner's first step on the whole batch at Adam's default eps, and how far
    another fp32 computation of that step may move each parameter from it
    (fp32.small_eps_update_tolerance, from the gradient's scales ``A`` and its value)."""
    learner = make_learner(copy.deepcopy(initial), eps=DEFAULT_EPS)
    before = {k: v.clone() for k, v in fp32.params(learner.model).items()}
    scales = fp32.gradient_scales(copy.deepcopy(initial), learner.objective, batch)
    grads = fp32.capture_grads(learner.model)
    learner.step(batch)
    tol = fp32.small_eps_update_tolerance(before, grads, fp32.gradient_tolerance(scales, batch),
                                          lr=LR, eps=DEFAULT_EPS, clip=GRAD_CLIP)
    return {"weights": {k: v.clone() for k, v in fp32.params(learner.model).items()}, "tol": tol}


@pytest.fixture(scope="module")
def group(model_dir: str, batch: TrainBatch) -> list[dict]:
    """Two ranks, each on its shard: DDP, FSDP2 and the control (see group_run)."""
    return spawn_learner_group(2, group_run, model_dir, batch, backend="gloo", timeout_s=180)


@torch.no_grad()
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------- sharding


def test_shard_bounds_by_hand() -> None:
    # 10 rows over 3 ranks: 4, 3, 3 (the larger block first)
    assert [shard_bounds(10, r, 3) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    # 10 rows in pairs over 2 ranks: 5 pairs -> 3 pairs, 2 pairs
    assert [shard_bounds(10, r, 2, unit=2) for r in range(2)] == [(0, 6), (6, 10)]
    assert shard_bounds(8, 0, 1) == (0, 8)


@pytest.mark.parametrize(("rows", "rank", "world", "unit", "match"), [
    (8, 2, 2, 1, r"rank=2 is not in \[0, world=2\)"),
    (8, -1, 2, 1, r"rank=-1"),
    (7, 0, 2, 2, r"7 rows do not split into units of 2"),
    (4, 0, 3, 2, r"4 rows \(2 units of 2\) cannot give each of 3 ranks .* at least 6 rows"),
])
def test_shard_bounds_rejects_what_cannot_be_split(rows: int, rank: int, world: int, unit: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shard_bounds(rows, rank, world, unit=unit)


def test_shards_partition_the_batch_in_order(batch: TrainBatch) -> None:
    shards = [shard_batch(batch, r, 3) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 2]
    assert torch.equal(torch.cat([s.input_ids for s in shards]), batch.input_ids)
    assert torch.equal(torch.cat([s.ref_logprobs for s in shards]), batch.ref_logprobs)
    assert all(s.prompt_len == batch.prompt_len for s in shards)


# ---------------------------------------------------------------- errors without a group


def test_init_group_names_the_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RuntimeError, match=r"MASTER_PORT, RANK, WORLD_SIZE not set; start .* torchrun"):
        init_group("gloo")


def test_parallelism_needs_a_group_and_a_known_strategy() -> None:
    for strategy in ("ddp", "fsdp2"):
        with pytest.raises(RuntimeError, match=rf"parallelism '{strategy}' needs a process group: call init_group"):
            make_parallelism(strategy)
    with pytest.raises(ValueError, match=r"strategy='zero3'; expected one of \['none', 'ddp', 'fsdp2'\]"):
        make_parallelism("zero3")


# ---------------------------------------------------------------- the group


def test_the_shards_differ_where_it_matters(batch: TrainBatch, group: list[dict]) -> None:
    """The comparisons below are meaningful: the shards have different token counts (a
    local denominator would weigh them differently) and split into different numbers of
    micro-batches (3 and 4; one process splits the whole batch into 7), so DDP syncs on
    each rank's own last micro-batch and FSDP2 pads rank 0 with one extra forward."""
    shards = [shard_batch(batch, r, 2) for r in range(2)]
    assert [float(s.loss_mask.sum()) for s in shards] == [17.0, 26.0]
    assert [g["micro_batches"] for g in group] == [3, 4]
    assert len(split_by_tokens(batch, BUDGET)) == 7


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_group_weights_equal_one_process_after_each_step(
    strategy: str, initial: torch.nn.Module, single: dict, group: list[dict]
) -> None:
    start = {k: v.detach() for k, v in initial.state_dict().items()}
    for step in range(2):
        ranks = [g[strategy]["weights"][step] for g in group]
        assert max_abs_diff(single["weights"][step], start) > 100 * PARAM_ATOL  # the step moved the weights
        assert max_abs_diff(ranks[0], single["weights"][step]) <= PARAM_ATOL, step
        assert max_abs_diff(ranks[0], ranks[1]) == 0.0  # every rank holds the same full weights
    assert [g[strategy]["version"] for g in group] == [2, 2]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_group_metrics_equal_one_process(strategy: str, single: dict, group: list[dict]) -> None:
    for step in range(2):
        expected = single["metrics"][step]
        ranks = [g[strategy]["metrics"][step] for g in group]
        assert ranks[0] == ranks[1]  # every rank reports the group's metrics
        got = ranks[0]
        assert got.keys() == expected.keys()
        assert {"loss", "loss/policy", "loss/kl", "grad_norm", "ratio_max", "clip_frac", "entropy"} <= got.keys()
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name)
        assert got["tokens"] == 43.0  # 17 + 26: summed, not averaged
        assert got["grad_norm"] > 10 * GRAD_CLIP  # the clip was active, on the global norm
        assert (got["skipped"], got["lr"]) == (0.0, LR)  # reported once, not summed over ranks


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_group_logprobs_equal_one_process(strategy: str, single: dict, group: list[dict]) -> None:
    """After two steps: each rank's log-probs of its shard are the one process's for
    those rows, also when the ranks predict different numbers of rows (1 and 2)."""
    torch.testing.assert_close(torch.cat([g[strategy]["logprobs"] for g in group]), single["logprobs"],
                               rtol=0, atol=1e-5)
    uneven = torch.cat([group[0][strategy]["uneven_logprobs"], group[1][strategy]["uneven_logprobs"]])
    torch.testing.assert_close(uneven, single["logprobs"][[0, 4, 5]], rtol=0, atol=1e-5)


def test_local_denominator_control_fails(initial: torch.nn.Module, single: dict, group: list[dict]) -> None:
    """Control: normalising each rank's loss by its own shard's token count (a mean of
    shard means) instead of the batch's moves the weights far beyond the tolerance."""
    control = group[0]["local_denominator"]
    assert max_abs_diff(control["weights"], single["weights"][0]) > 50 * PARAM_ATOL
    assert control["metrics"]["grad_norm"] != pytest.approx(single["metrics"][0]["grad_norm"], rel=1e-2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_group_first_step_at_default_eps_within_the_derived_bound(
    strategy: str, default_eps_bound: dict, group: list[dict]
) -> None:
    """Adam's default eps=1e-8: every parameter after the group's first step is within
    the derived per-entry bound of one process's, on every rank, and the bound is tight
    enough that the control (per-shard denominators) breaks it."""
    for rank in group:
        weights = {k: rank[f"{strategy}_default_eps"]["weights"][k] for k in default_eps_bound["weights"]}
        fp32.assert_within(weights, default_eps_bound["weights"], default_eps_bound["tol"],
                           f"{strategy} parameters at eps={DEFAULT_EPS}")
    control = {k: group[0]["local_denominator_default_eps"]["weights"][k] for k in default_eps_bound["weights"]}
    worst, _ = fp32.worst_excess(control, default_eps_bound["weights"], default_eps_bound["tol"])
    assert worst > 10.0, worst


def test_a_failing_rank_fails_the_group_with_its_error() -> None:
    """Rank 1 raises while rank 0 waits for it in a barrier: the caller gets rank 1's
    error, named as the first, instead of a hang."""
    # rank 0 may or may not get to report its own (consequent) error before it is stopped
    first_rank_one = r"(?s)failed on rank\(s\) \[1(, 0)?\], rank 1 first.*ValueError: rank 1 fails on purpose"
    with pytest.raises(RuntimeError, match=first_rank_one):
        spawn_learner_group(2, fail_on_rank_one, backend="gloo", timeout_s=120)
