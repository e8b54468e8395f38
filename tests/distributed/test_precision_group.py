"""fp16 in a learner group (gloo, 2 ranks): DDP (``torch.amp.GradScaler``) and FSDP2
(``ShardedGradScaler``) take the same steps as one fp16 process on the whole batch: the
same overflow skipped on every rank, the same loss scale, the same weights within the
tolerance below; the per-shard-denominator control does not. An FSDP2 group resumed from
its sharded checkpoint takes the step the group that did not stop takes, to the bit,
with the loss scale it had."""

from __future__ import annotations

import pytest
import torch
from precision_workers import (blown_up, fp16_group_run, fp16_learner, fp16_mesh_run, fp16_reference,
                               fp16_resume, three_steps)

from learner_group_workers import LR, make_batch
from rltune.learner.launch import spawn_learner_group
from rltune.models.load import load_model

# Tolerance on the weights after the three steps (two applied). Each applied Adam step
# moves a weight by at most lr = 1e-3 (|m / sqrt(v)| <= 1 on the first steps), so a real
# mistake moves weights by a sizeable part of lr (the per-shard denominator control:
# 1.4e-4; an unscaled gradient: Adam's ~lr-sized sign steps). The group and the single
# process run the same fp16 arithmetic on differently split micro-batches: their gradients
# differ by the fp16 rounding of each micro-batch's weight gradient (2^-11 = 4.9e-4
# relative), which moves an Adam update by at most lr * 4.9e-4 / 4 = 1.2e-7 per unit of
# relative error (the slope of g / (|g| + eps) is largest at |g| = eps); cancellations
# amplify the relative error of small gradient entries, so measured: 9e-7 (DDP), 8e-7
# (FSDP2). lr / 100 = 1e-5 is 10x that and 14x below the control.
TOL = LR / 100


@pytest.fixture(scope="module")
def batch(model_dir: str):
    return make_batch(load_model(model_dir))


@pytest.fixture(scope="module")
def single(model_dir: str, batch) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return three_steps(fp16_learner(load_model(model_dir)), batch, blown_up(batch))
    finally:
        torch.set_num_threads(threads)


def _spawn(model_dir: str, batch, *names: str) -> list[dict]:
    return spawn_learner_group(2, fp16_group_run, model_dir, batch, names, backend="gloo", timeout_s=300)


@pytest.fixture(scope="module")
def sharded(model_dir: str, batch) -> list[dict]:
    """FSDP2 (the sharded scaler)."""
    return _spawn(model_dir, batch, "fsdp2")


@pytest.fixture(scope="module")
def replicated(model_dir: str, batch) -> list[dict]:
    """DDP and the control."""
    return _spawn(model_dir, batch, "ddp", "control")


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_single_process_overflows_once_and_recovers(single: dict) -> None:
    skipped = [m["train/skipped_overflow"] for m in single["metrics"]]
    scales = [m["train/loss_scale"] for m in single["metrics"]]
    assert skipped == [0.0, 1.0, 0.0] and scales == [2.0**16, 2.0**15, 2.0**15]
    assert single["version"] == 2


@pytest.mark.slow  # ~25 s on the shared 2-core machine, mostly starting the processes
def test_fp16_fsdp2_equals_one_process(single: dict, sharded: list[dict]) -> None:
    check_group("fsdp2", single, sharded)


@pytest.mark.slow
def test_fp16_ddp_equals_one_process(single: dict, replicated: list[dict]) -> None:
    check_group("ddp", single, replicated)


def check_group(strategy: str, single: dict, group: list[dict]) -> None:
    for rank in group:
        run = rank[strategy]
        assert run["version"] == single["version"]
        for mine, want in zip(run["metrics"], single["metrics"]):
            for key in ("train/skipped_overflow", "train/loss_scale", "skipped"):
                assert mine[key] == want[key], (strategy, key)
        diff = max_abs_diff(run["weights"], single["weights"])
        assert diff < TOL, (strategy, diff)


def test_training_moved_the_weights_beyond_the_tolerance(single: dict, model_dir: str) -> None:
    """Equal weights mean something only if the steps moved them by more than the tolerance."""
    initial = {k: v for k, v in load_model(model_dir).state_dict().items()}
    assert max_abs_diff(single["weights"], initial) > 10 * TOL


@pytest.mark.slow
def test_per_shard_denominator_control_is_refused(single: dict, replicated: list[dict]) -> None:
    diff = max_abs_diff(replicated[0]["control"]["weights"], single["weights"])
    assert diff > TOL


# --------------------------------------------------------------------------- tp, ep


@pytest.mark.slow
@pytest.mark.parametrize(("model_path", "layout"), [("builtin:tiny", {"tp": 2}), ("builtin:tiny-moe", {"ep": 2})],
                         ids=["tp=2", "ep=2"])
def test_fp16_mesh_layout_equals_one_process(model_path: str, layout: dict) -> None:
    """Tensor and expert parallelism in fp16: each rank unscales its own DTensor (or
    expert) shards and the overflow flag is all-reduced over the group, so every rank
    takes the single process's steps (same tolerance as above)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = fp16_reference(model_path)
    finally:
        torch.set_num_threads(threads)
    for rank in spawn_learner_group(2, fp16_mesh_run, model_path, layout, backend="gloo", timeout_s=300):
        assert [m["train/skipped_overflow"] for m in rank["metrics"]] == [0.0, 1.0, 0.0]
        assert [m["train/loss_scale"] for m in rank["metrics"]] == [m["train/loss_scale"] for m in want["metrics"]]
        assert max_abs_diff(rank["weights"], want["weights"]) < TOL


# --------------------------------------------------------------------------- sharded resume


@pytest.mark.slow  # ~20 s each, mostly starting the processes
@pytest.mark.parametrize("layout", ["fsdp2", "dp_shard"])
def test_fp16_group_resume_is_the_group_that_did_not_stop(model_dir: str, batch, tmp_path, layout: str) -> None:
    """Saved after an overflow (scale 2^15, one overflow counted), an fp16 group's
    checkpoint carries the scaler's state, in the FSDP2 strategy's gathered file and in a
    mesh's DCP shards: the resumed group's next step equals the uninterrupted one to the
    bit (same layout, same arithmetic), loss scale and overflow count included. The
    control, resumed without the scaler's state, starts again from 2^16, which its
    step's loss scale shows. Rank 0 keeps the state it was given while its group takes
    the next step, so a state that shared memory with the live optimizer (the FSDP2
    strategy's unsharded Adam ``step`` counters did) would resume one step later."""
    ranks = spawn_learner_group(2, fp16_resume, model_dir, batch, layout, str(tmp_path),
                                backend="gloo", timeout_s=300)
    for rank in ranks:
        assert rank["format"]["format"] == ("dcp" if layout == "dp_shard" else "full"), rank["format"]
        assert [m["train/skipped_overflow"] for m in rank["before"]] == [0.0, 1.0]
        saved = rank["meta"]["learner"]["precision"]
        assert saved == {"scale": 2.0**15, "growth_tracker": 0, "overflows": 1}
        assert rank["loaded_state"] == saved
        assert rank["resumed"] == rank["uninterrupted"]
        assert rank["resumed"]["train/loss_scale"] == 2.0**15 and rank["resumed"]["skipped"] == 0.0
        assert rank["resumed_state"] == rank["state"]
        changed = [k for k in rank["uninterrupted_weights"]
                   if not torch.equal(rank["resumed_weights"][k], rank["uninterrupted_weights"][k])]
        assert changed == []
        assert rank["control"]["train/loss_scale"] == 2.0**16
