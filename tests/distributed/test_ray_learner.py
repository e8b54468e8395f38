"""The learner group as Ray actors (``rltune/runtime/ray/learner.py``) on a local Ray: two
learner actors (gloo, CPU) train the built-in tiny model as one in-process LocalLearner of
the same config does on the whole batch (weights after each of two steps, metrics,
log-probs, exported weights), their checkpoint has the LocalLearner's format and restores
into a fresh group exactly, and a killed actor is reported as ``LearnerDied`` at once.

Tolerances: those of tests/distributed/test_learner_group.py, for the same reasons (the
group sums the same fp32 gradients in another order): parameters within PARAM_ATOL = 1e-6,
metrics rel 1e-5, log-probs 1e-5. They need Adam's eps = 1e-3 (with the default 1e-8 the
optimizer turns fp32 rounding of near-zero gradients into ~1e-5 parameter differences).
``train`` has no eps setting, so the local learner's param groups are set as in
test_learner_group.py, and every rank's through ``RayLearnerGroup.run_on_ranks`` before
the first step: the same change to the same optimizer, made where each optimizer lives.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from learner_group_workers import (  # noqa: E402
    ADAM_EPS,
    BUDGET,
    GRAD_CLIP,
    LR,
    algo_config,
    make_batch,
)

from rltune.checkpoint.store import load_checkpoint, save_checkpoint  # noqa: E402
from rltune.config.schema import (  # noqa: E402
    Config,
    ModelConfig,
    PlacementConfig,
    RewardFnConfig,
    RoleResources,
    RuntimeConfig,
    TrainConfig,
)
from rltune.data.records import TrainBatch  # noqa: E402
from rltune.learner.learner import LocalLearner  # noqa: E402
from rltune.learner.pair_scoring import weights_fingerprint  # noqa: E402
from rltune.learner.objectives import build_objective  # noqa: E402
from rltune.metrics.types import scalars  # noqa: E402
from rltune.models.load import load_model  # noqa: E402
from rltune.runtime.roles import (  # noqa: E402
    learner_options,
    load_policy,
    lookup_algorithm,
    seed_everything,
)
from rltune.runtime.ray.cluster import place  # noqa: E402
from rltune.runtime.ray.learner import LearnerDied, RayLearnerGroup, WeightsRef  # noqa: E402
from rltune.runtime.state import learner_state  # noqa: E402

# the functions sent to the actors are defined here; the actors cannot import this module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PARAM_ATOL = 1e-6
CALL_TIMEOUT_S = 120.0
"""Every group call here gives up after this long instead of hanging."""


def make_config(model_dir: str, strategy: str = "ddp") -> Config:
    """GRPO with the learner-group tests' objective, budget, clip and lr; two learner
    actors of one CPU each. The reward entry only satisfies the config's check that an
    online algorithm has one: nothing is scored here."""
    return Config(
        model=ModelConfig(path=model_dir),
        algo=algo_config(),
        reward=(RewardFnConfig(fn="unused.py:reward"),),
        train=TrainConfig(lr=LR, grad_clip=GRAD_CLIP, micro_batch_tokens=BUDGET),
        runtime=RuntimeConfig(mode="ray", placement=PlacementConfig(
            learners=2, learner_strategy=strategy, learner=RoleResources(cpus=1),
            generator=RoleResources(cpus=0.25), scorer=RoleResources(cpus=0.25),
        )),
    )


def set_adam_eps(learner: LocalLearner, eps: float) -> None:
    for group in learner.optimizer.param_groups:
        group["eps"] = eps


@torch.no_grad()
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def cfg(model_dir: str) -> Config:
    return make_config(model_dir)


@pytest.fixture(scope="module")
def batch(model_dir: str) -> TrainBatch:
    return make_batch(load_model(model_dir))


@pytest.fixture(scope="module")
def local(cfg: Config, model_dir: str, batch: TrainBatch) -> dict:
    """One LocalLearner built as build_run builds it: four steps on the whole batch
    (metrics and weights after each), its checkpoint state before the first, and its
    log-probs and checkpoint state after two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seed_everything(cfg.train.seed)
        algorithm = lookup_algorithm(cfg.algo.name)
        model = load_policy(cfg, model_dir)
        objective = build_objective(algorithm, cfg.algo, max_len=cfg.rollout.max_new_tokens)
        learner = LocalLearner(model, objective, cfg.train, **learner_options(cfg, algorithm, model))
        set_adam_eps(learner, ADAM_EPS)
        out: dict = {"metrics": [], "weights": [], "state0": state_summary(*learner_state(learner, ""))}
        for step in range(4):
            out["metrics"].append(scalars(learner.step(batch)))
            out["weights"].append({k: v.clone() for k, v in learner.export_weights().items()})
            if step == 1:
                out["logprobs"] = learner.logprobs(batch)
                out["state"] = state_summary(*learner_state(learner, ""))
        return out
    finally:
        torch.set_num_threads(threads)


def state_summary(tensors: dict, meta: dict) -> dict:
    """What a learner checkpoint must share with a LocalLearner's: its tensor names per
    file, and its meta but for the weights' values."""
    return {"keys": {k: set(v) for k, v in tensors.items()}, "meta": meta}


def start_group(cfg: Config, name: str):
    """A placement and a group in it, with the tests' Adam eps; yields the group."""
    placement = place(cfg.runtime.placement, name=name)
    group = RayLearnerGroup(cfg, cfg.model.path, placement, timeout_s=CALL_TIMEOUT_S)
    try:
        group.run_on_ranks(set_adam_eps, ADAM_EPS)
        yield group
    finally:
        group.close()
        placement.remove()


def checkpoint(group: RayLearnerGroup, root: Path, step: int) -> dict:
    """The group's learner state written to disk as ``runtime/state.py`` writes it."""
    tensors, meta = group.checkpoint_state("")
    path = save_checkpoint(root, step, tensors=tensors, meta=meta, keep=1)
    return {"path": path, **state_summary(tensors, meta)}


def restore(group: RayLearnerGroup, saved: dict) -> None:
    tensors, meta = load_checkpoint(saved["path"])
    group.load_checkpoint_state(tensors, meta, saved["path"], "")


@pytest.fixture(scope="module")
def group(ray_cluster, cfg: Config):
    """Two learner actors with DDP."""
    yield from start_group(cfg, "test-learner-ddp")


@pytest.fixture(scope="module")
def fsdp(ray_cluster, model_dir: str):
    """A fresh group of two learner actors with FSDP2."""
    yield from start_group(make_config(model_dir, "fsdp2"), "test-learner-fsdp2")


@pytest.fixture(scope="module")
def trained(group: RayLearnerGroup, batch: TrainBatch, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The DDP group: two steps (metrics and fetched weights after each), then its
    log-probs, an exported WeightsRef and its checkpoint."""
    out: dict = {"metrics": [], "weights": []}
    for _ in range(2):
        out["metrics"].append(scalars(group.step(batch)))
        out["weights"].append(group.fetch_weights())
    out["version"] = group.version
    out["logprobs"] = group.logprobs(batch)
    out["one_row"] = group.pair_outputs(batch.select(slice(0, 1)), "logprobs")
    out["fingerprint"] = group.weights_fingerprint()
    out["exported"] = group.export_weights()
    out["sync_s"] = group.last_sync_s
    out["checkpoint"] = checkpoint(group, tmp_path_factory.mktemp("ckpt-ddp"), 2)
    return out


@pytest.fixture(scope="module")
def resumed_fsdp(fsdp: RayLearnerGroup, trained: dict, batch: TrainBatch,
                 tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fresh FSDP2 group: its checkpoint before any step; then it resumes from the DDP
    group's checkpoint (version and weights right after loading), takes the third step,
    and writes its own checkpoint."""
    out = {"version_before": fsdp.version, "state0": state_summary(*fsdp.checkpoint_state(""))}
    restore(fsdp, trained["checkpoint"])
    out["version_loaded"] = fsdp.version
    out["weights_loaded"] = fsdp.fetch_weights()
    out["fingerprint"] = fsdp.weights_fingerprint()
    out["one_row"] = fsdp.pair_outputs(batch.select(slice(0, 1)), "logprobs")
    out["logprobs_loaded"] = fsdp.logprobs(batch)
    out["metrics"] = scalars(fsdp.step(batch))
    out["version"] = fsdp.version
    out["weights"] = fsdp.fetch_weights()
    out["logprobs"] = fsdp.logprobs(batch)
    out["checkpoint"] = checkpoint(fsdp, tmp_path_factory.mktemp("ckpt-fsdp2"), 3)
    return out


@pytest.fixture(scope="module")
def resumed_ddp(group: RayLearnerGroup, resumed_fsdp: dict, batch: TrainBatch) -> dict:
    """The DDP group (by then at version 2) resumes from the FSDP2 group's checkpoint and
    takes the fourth step."""
    restore(group, resumed_fsdp["checkpoint"])
    out = {"version_loaded": group.version, "weights_loaded": group.fetch_weights()}
    out["metrics"] = scalars(group.step(batch))
    out["version"] = group.version
    out["weights"] = group.fetch_weights()
    return out


def assert_metrics_match(got: dict, expected: dict, where: object) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (where, name)


def assert_checkpoint_like_local(saved: dict, local: dict, version: int) -> None:
    """Same tensor names and the same meta as the LocalLearner's checkpoint, up to the
    counters and the schedule's position."""
    assert saved["keys"] == local["state"]["keys"]
    meta, expected = saved["meta"], local["state"]["meta"]
    assert meta.keys() == expected.keys()
    assert meta["model"] == expected["model"] == {"format": "full"}
    assert meta["optimizer"] == expected["optimizer"]
    assert meta["learner"] == {"version": version, "nonfinite_in_a_row": 0, "nonfinite_total": 0, "precision": {}}
    assert meta["scheduler"]["last_epoch"] == version


# ---------------------------------------------------------------- the DDP group


def test_group_weights_equal_one_process_after_each_step(cfg: Config, local: dict, trained: dict) -> None:
    start = {k: v.detach() for k, v in load_policy(cfg, cfg.model.path).state_dict().items()}
    for step in range(2):
        assert max_abs_diff(local["weights"][step], start) > 100 * PARAM_ATOL  # the step moved the weights
        assert max_abs_diff(trained["weights"][step], local["weights"][step]) <= PARAM_ATOL, step
    assert trained["version"] == 2


def test_group_metrics_equal_one_process(local: dict, trained: dict) -> None:
    for step in range(2):
        got = trained["metrics"][step]
        assert {"loss", "loss/policy", "loss/kl", "grad_norm", "clip_frac", "entropy"} <= got.keys()
        assert_metrics_match(got, local["metrics"][step], step)
        assert got["tokens"] == 43.0  # both shards' tokens
        assert got["grad_norm"] > 10 * GRAD_CLIP  # the clip was active, on the global norm


def test_group_logprobs_equal_one_process(local: dict, trained: dict) -> None:
    assert trained["logprobs"].shape == local["logprobs"].shape
    torch.testing.assert_close(trained["logprobs"], local["logprobs"], rtol=0, atol=1e-5)


def test_export_weights_is_a_ref_to_rank_zeros_weights(local: dict, trained: dict) -> None:
    exported: WeightsRef = trained["exported"]
    assert isinstance(exported.ref, ray.ObjectRef)
    assert exported.version == 2
    assert trained["sync_s"] > 0.0
    weights = ray.get(exported.ref, timeout=CALL_TIMEOUT_S)
    assert all(t.device.type == "cpu" for t in weights.values())
    assert max_abs_diff(weights, local["weights"][1]) <= PARAM_ATOL
    assert max_abs_diff(weights, trained["weights"][1]) == 0.0


def test_group_has_no_model_attribute(group: RayLearnerGroup) -> None:
    assert not hasattr(group, "model")


def test_a_batch_of_fewer_rows_than_ranks_is_scored_by_the_group(trained: dict, resumed_fsdp: dict) -> None:
    """One row on two ranks (DDP, FSDP2): the group pads it with a copy so that every rank
    takes part, and returns that row's log-probs alone. 1e-5: the row computed alone
    against within the whole batch, where fp32 products over other row counts may round
    differently by a few ulps of |log p| < 10."""
    for out, every_row in ((trained, trained["logprobs"]), (resumed_fsdp, resumed_fsdp["logprobs_loaded"])):
        assert out["one_row"].shape == every_row[:1].shape
        torch.testing.assert_close(out["one_row"], every_row[:1], rtol=0, atol=1e-5)


def test_the_group_fingerprints_its_weights_as_one_process_does(model_dir: str, trained: dict,
                                                                 resumed_fsdp: dict) -> None:
    """DDP: every rank holds the whole model, so the group's fingerprint is one process's
    of the same weights (a one-process run's reference cache fits a DDP run). FSDP2, with
    the same weights loaded: each rank fingerprints its own shards, so the print differs."""
    model = load_model(model_dir)
    model.load_state_dict(trained["weights"][1])
    assert trained["fingerprint"] == weights_fingerprint(model)
    assert resumed_fsdp["fingerprint"] not in (trained["fingerprint"], None)


def test_checkpoint_has_the_local_learners_format(local: dict, trained: dict) -> None:
    assert_checkpoint_like_local(trained["checkpoint"], local, version=2)


# ---------------------------------------------------------------- checkpoints across groups, FSDP2


def test_a_fresh_fsdp2_group_resumes_from_the_ddp_checkpoint(trained: dict, resumed_fsdp: dict) -> None:
    """Loading gives the saved version and exactly the saved weights (FSDP2 shards them
    and gathers them back)."""
    assert resumed_fsdp["version_before"] == 0
    assert resumed_fsdp["version_loaded"] == 2
    assert max_abs_diff(resumed_fsdp["weights_loaded"], trained["weights"][1]) == 0.0


def test_fsdp2_checkpoint_before_the_first_step_has_no_optimizer_state(local: dict, resumed_fsdp: dict) -> None:
    """Gathering FSDP2's optimizer state before its first step would create it (torch
    initialises it with a zero-gradient step); the group's checkpoint is the local one's."""
    assert resumed_fsdp["state0"]["keys"] == local["state0"]["keys"]
    assert resumed_fsdp["state0"]["keys"]["optimizer"] == set()
    assert resumed_fsdp["state0"]["meta"]["optimizer"] == local["state0"]["meta"]["optimizer"]


def test_fsdp2_group_steps_as_one_process(local: dict, resumed_fsdp: dict) -> None:
    """The step after resuming is the local learner's third: weights, metrics, and so the
    optimizer's moments and the schedule came through the checkpoint too."""
    assert resumed_fsdp["version"] == 3
    assert max_abs_diff(resumed_fsdp["weights"], local["weights"][2]) <= PARAM_ATOL
    assert max_abs_diff(resumed_fsdp["weights"], local["weights"][1]) > 100 * PARAM_ATOL
    assert_metrics_match(resumed_fsdp["metrics"], local["metrics"][2], "fsdp2 step 3")


def test_fsdp2_checkpoint_has_the_local_learners_format(local: dict, resumed_fsdp: dict) -> None:
    assert_checkpoint_like_local(resumed_fsdp["checkpoint"], local, version=3)


def test_ddp_group_resumes_from_the_fsdp2_checkpoint(local: dict, resumed_fsdp: dict, resumed_ddp: dict) -> None:
    """The DDP group, at version 2, loads the FSDP2 group's version 3 and then steps as
    the local learner's fourth step."""
    assert resumed_ddp["version_loaded"] == 3
    assert max_abs_diff(resumed_ddp["weights_loaded"], resumed_fsdp["weights"]) == 0.0
    assert resumed_ddp["version"] == 4
    assert max_abs_diff(resumed_ddp["weights"], local["weights"][3]) <= PARAM_ATOL
    assert_metrics_match(resumed_ddp["metrics"], local["metrics"][3], "ddp step 4")


# ---------------------------------------------------------------- failure


def test_a_killed_learner_raises_learner_died_naming_its_rank(
    group: RayLearnerGroup, resumed_ddp: dict, batch: TrainBatch
) -> None:
    """Rank 1 is killed; rank 0 receives the step and waits for it in a collective. The
    step raises LearnerDied naming rank 1 within seconds, and the group is closed.
    (Requests ``resumed_ddp`` so that it runs after every other use of the group.)"""
    ray.kill(group.actors[1], no_restart=True)
    start = time.monotonic()
    with pytest.raises(LearnerDied, match=r"learner rank 1 of 2 died during step"):
        group.step(batch)
    assert time.monotonic() - start < 10.0
    assert group.closed
    with pytest.raises(LearnerDied, match=r"the learner group is closed"):
        group.logprobs(batch)
