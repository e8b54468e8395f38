"""Data-parallel layouts of the learner mesh (``rltune.parallel``) train the built-in tiny
model as one process does on the whole batch: the same loss and gradient norm at each of
two optimizer steps, and the same weights after them.

Tolerances (as in test_learner_group.py). Everything runs in fp32. A layout's gradient is
the same sum as one process's in another order (each rank's micro-batches, then the
ranks' reduce-scatter or all-reduce), so gradient components differ by fp32 rounding,
~1e-7 relative. Adam's eps is 1e-3 (layout_workers), so its slope is <= lr/eps = 1 and
that rounding moves parameters by < 1e-7 per step: PARAM_ATOL = 1e-6 after two steps,
while a step moves them by ~1e-3. Loss and gradient norm are sums of the same fp32
numbers in another order: rel 1e-5. The control (each rank normalising by its own
shard's token count) moves the weights by far more than PARAM_ATOL.
"""

from __future__ import annotations

import sys

import pytest
import torch
from layout_workers import several

from rltune.learner.launch import spawn_learner_group
from rltune.models.load import load_model

PARAM_ATOL = 1e-6
TWO_RANKS = [({"dp_shard": 2}, None), ({"dp_replicate": 2}, None), ({"dp_shard": 2}, "local_denominator")]


@pytest.fixture(scope="module")
def two_ranks(model_dir: str) -> list[list[dict]]:
    """Two ranks: dp_shard=2, dp_replicate=2 and the control, one after the other."""
    return spawn_learner_group(2, several, model_dir, TWO_RANKS, backend="gloo", timeout_s=300)


@torch.no_grad()
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_equals_reference(ranks: list[dict], single: dict, initial: dict[str, torch.Tensor]) -> None:
    """Every rank: the reference's loss and grad norm at each step, its weights after the
    last, and the same full weights as rank 0."""
    assert max_abs_diff(single["params"], initial) > 100 * PARAM_ATOL  # the steps moved the weights
    for rank in ranks:
        assert rank["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert rank["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
        assert max_abs_diff(rank["params"], single["params"]) <= PARAM_ATOL
        assert max_abs_diff(rank["params"], ranks[0]["params"]) == 0.0
        assert rank["metrics"] == ranks[0]["metrics"]  # every rank reports the group's metrics


@pytest.fixture(scope="module")
def initial(model_dir: str) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in load_model(model_dir).state_dict().items()}


@pytest.mark.parametrize("index", [0, 1], ids=["dp_shard=2", "dp_replicate=2"])
def test_two_rank_layout_equals_one_process(index: int, two_ranks: list[list[dict]], single: dict,
                                            initial: dict) -> None:
    ranks = [rank[index] for rank in two_ranks]
    assert [r["data_rank"] for r in ranks] == [0, 1] and {r["data_world"] for r in ranks} == {2}
    assert_equals_reference(ranks, single, initial)


def test_local_denominator_control_fails(two_ranks: list[list[dict]], single: dict) -> None:
    """Control: per-shard denominators move the weights far beyond the tolerance."""
    control = two_ranks[0][2]
    assert max_abs_diff(control["params"], single["params"]) > 50 * PARAM_ATOL
    assert control["grad_norm"][0] != pytest.approx(single["grad_norm"][0], rel=1e-2)


@pytest.mark.slow
def test_hsdp_two_by_two_equals_one_process(model_dir: str, single: dict, initial: dict) -> None:
    """dp_replicate=2 x dp_shard=2 (4 processes): HSDP, shards of 2 rows each."""
    out = spawn_learner_group(4, several, model_dir, [({"dp_replicate": 2, "dp_shard": 2}, None)],
                              backend="gloo", timeout_s=600)
    ranks = [rank[0] for rank in out]
    assert [r["data_rank"] for r in ranks] == [0, 1, 2, 3]
    assert_equals_reference(ranks, single, initial)


# ---------------------------------------------------------------- the Ray learner group


def test_outputs_come_from_one_actor_per_data_rank_in_order() -> None:
    """The driver reassembles a batch from the actors' positions alone: tp peers (same
    data rank) answer once; with pp only the last stage's answer is the model's."""
    from rltune.runtime.ray.learner_layout import Position, output_actors

    # dp_shard=2 x tp=2: actors 0,1 are data rank 0, actors 2,3 data rank 1
    tp_peers = [Position(0, 2, True), Position(0, 2, True), Position(1, 2, True), Position(1, 2, True)]
    assert output_actors(tp_peers) == [0, 2]
    # pp=2 x dp_shard=2: the first stage (actors 0, 1) holds no outputs
    stages = [Position(0, 2, False), Position(1, 2, False), Position(0, 2, True), Position(1, 2, True)]
    assert output_actors(stages) == [2, 3]
    with pytest.raises(RuntimeError, match=r"no actor holds the outputs of data rank\(s\) \[1\]"):
        output_actors([Position(0, 2, True), Position(1, 2, False)])


@pytest.mark.slow
def test_ray_group_at_tp2_trains_as_one_process(ray_cluster, model_dir: str, single: dict) -> None:
    """``train.parallel.tp=2`` on two Ray learner actors: both train on the whole batch
    (one data rank), the group's two steps and log-probs equal one process's."""
    from layout_workers import global_batch
    from learner_group_workers import ADAM_EPS, BUDGET, GRAD_CLIP, LR, algo_config

    from rltune.config.parallel import ParallelConfig
    from rltune.config.schema import Config, ModelConfig, PlacementConfig, RewardFnConfig, RoleResources
    from rltune.config.schema import RuntimeConfig, TrainConfig
    from rltune.metrics.types import scalars
    from rltune.runtime.ray.cluster import place
    from rltune.runtime.ray.learner import RayLearnerGroup
    from rltune.runtime.ray.learner_layout import Position

    cfg = Config(
        model=ModelConfig(path=model_dir), algo=algo_config(), reward=(RewardFnConfig(fn="unused.py:reward"),),
        train=TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET, parallel=ParallelConfig(tp=2)),
        runtime=RuntimeConfig(mode="ray", placement=PlacementConfig(
            learners=2, learner=RoleResources(cpus=1), generator=RoleResources(cpus=0.25),
            scorer=RoleResources(cpus=0.25))),
    )
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _set_adam_eps, for the actors
    batch = global_batch(model_dir, 0)
    placement = place(cfg.runtime.placement, name="test-layout-tp2")
    group = RayLearnerGroup(cfg, model_dir, placement, timeout_s=300)
    try:
        assert group.strategy == "mesh" and group.positions == [Position(0, 1, True)] * 2
        group.run_on_ranks(_set_adam_eps, ADAM_EPS)
        metrics = [scalars(group.step(batch)) for _ in range(2)]
        weights = group.fetch_weights()
    finally:
        group.close()
        placement.remove()
    assert [m["loss"] for m in metrics] == pytest.approx(single["loss"], rel=1e-5)
    assert [m["grad_norm"] for m in metrics] == pytest.approx(single["grad_norm"], rel=1e-5)
    assert max_abs_diff(weights, single["params"]) <= PARAM_ATOL


def _set_adam_eps(learner, eps: float) -> None:
    for group in learner.optimizer.param_groups:
        group["eps"] = eps


@pytest.mark.slow
def test_mesh_helpers_name_each_ranks_rows_and_data_meshes() -> None:
    """Four ranks: at dp_shard=2 x tp=2 the tp peers share a data rank (ranks 0,1 -> 0;
    2,3 -> 1); at dp_replicate=2 x ep=2 every rank has its own rows, the dense weights'
    mesh is 2 x 2 and the experts' is 2 x 1 (ep splits them instead)."""
    from layout_workers import mesh_positions

    out = spawn_learner_group(4, mesh_positions, [{"dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "ep": 2}],
                              backend="gloo", timeout_s=300)
    tp_layout = [rank[0] for rank in out]
    assert [(r["data_rank"], r["tp_rank"]) for r in tp_layout] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(r["data_world"], str(r["dense"]), str(r["experts"])) for r in tp_layout} == {(2, "[1, 2]", "[1, 2]")}
    ep_layout = [rank[1] for rank in out]
    assert [r["data_rank"] for r in ep_layout] == [0, 1, 2, 3]
    assert {(r["data_world"], str(r["dense"]), str(r["experts"])) for r in ep_layout} == {(4, "[2, 2]", "[2, 1]")}
