"""Activation checkpointing and FSDP2's CPU offload in a learner group of two processes
(gloo, CPU): every run trains like one process on the whole batch without either.

Tolerances (as tests/distributed/test_layouts_tp.py): the group's gradient is the same fp32
sum as one process's in another order, ~1e-7 relative per component; checkpointing
recomputes the same arithmetic (bitwise on CPU, tests/unit/learner/test_learner_memory.py)
and offload moves the same values between host buffers (on a CPU group the "device" is
the host, so it exercises FSDP2's offload path, not a transfer). With Adam eps=1e-3 the
update's slope is <= lr/eps = 1, so parameters agree within PARAM_ATOL = 1e-6 after two
steps while a step moves them by ~1e-3; loss and gradient norm rel 1e-5."""

from __future__ import annotations

import pytest
import torch

from rltune.learner.launch import spawn_learner_group

PARAM_ATOL = 1e-6


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


FAST_RUNS = [
    ("fsdp2", None, {}),
    ("fsdp2", None, {"offload": "params", "activation_checkpointing": "full"}),
]
"""The default set's representative: FSDP2 with offloaded shards and every block
checkpointed, against FSDP2 without either (one process start, ~20 s)."""
RUNS = [
    ("ddp", None, {"activation_checkpointing": "full"}),
    ("fsdp2", None, {"activation_checkpointing": "selective"}),
    ("fsdp2", None, {}),
    ("fsdp2", None, {"offload": "params"}),
    ("mesh", {"dp_shard": 2}, {"offload": "params"}),
    ("mesh", {"tp": 2, "dp_shard": 1}, {"activation_checkpointing": "full"}),
    ("mesh", {"pp": 2, "dp_shard": 1}, {"activation_checkpointing": "full"}),
]


def check_runs(runs: list, results: list[list[dict]], single: dict, blocks: int = 4) -> None:
    """Every run on every rank trains like one process; with offload also like FSDP2
    without it; the blocks checkpointed (of ``blocks``, split over the pipeline stages)
    and the shards offloaded as configured."""
    plain_fsdp2 = runs.index(("fsdp2", None, {})) if ("fsdp2", None, {}) in runs else None
    for i, (strategy, layout, train) in enumerate(runs):
        for rank, ranks in enumerate(results):
            got, where = ranks[i], f"{strategy} {layout} {train}, rank {rank}"
            assert got["loss"] == pytest.approx(single["loss"], rel=1e-5), where
            assert got["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5), where
            assert max_abs_diff(got["params"], single["params"]) <= PARAM_ATOL, where
            assert got["metrics"] == results[0][i]["metrics"], where
            ac = train.get("activation_checkpointing", "none")
            local = blocks // (layout or {}).get("pp", 1)
            assert got["checkpointed"] == {"none": 0, "selective": local // 2, "full": local}[ac], where
            assert got["offloaded"] == (train.get("offload") == "params"), where
            if train.get("offload") == "params" and plain_fsdp2 is not None:
                assert max_abs_diff(got["params"], ranks[plain_fsdp2]["params"]) <= PARAM_ATOL, where


@pytest.mark.slow
def test_checkpointing_and_offload_train_like_one_process_and_offload_resumes(
        model_dir: str, single: dict, tmp_path) -> None:
    """DDP with full and FSDP2 with selective checkpointing, FSDP2 with offloaded shards
    (the learner_strategy path and the mesh path), tp=2 and pp=2 with checkpointing; with
    offloaded shards a sharded checkpoint resumes to the bit, the optimizer state in
    host memory."""
    from memory_workers import runs_and_resume

    results = spawn_learner_group(2, runs_and_resume, model_dir, RUNS, str(tmp_path / "ckpt"),
                                  backend="gloo", timeout_s=900)
    check_runs(RUNS, [r["runs"] for r in results], single)
    plain_fsdp2 = RUNS.index(("fsdp2", None, {}))
    for rank in results:
        resume = rank["resume"]
        assert resume["state_devices"] == [["cpu"], ["cpu"]]
        assert all(torch.equal(resume["straight"][k], resume["resumed"][k]) for k in resume["straight"])
        # two steps on the shard with offload: FSDP2's two steps without it
        assert max_abs_diff(resume["straight"], rank["runs"][plain_fsdp2]["params"]) <= PARAM_ATOL


@pytest.mark.slow
def test_checkpointing_with_expert_parallelism_trains_like_one_process(tmp_path_factory) -> None:
    """Qwen2-MoE at ep=2 with every block checkpointed: the recompute reruns the
    experts' all-to-all on both ranks alike, and the update is one process's."""
    from layout_workers import reference
    from memory_workers import memory_runs

    from rltune.models.load import resolve_model

    moe_dir = resolve_model("builtin:tiny-moe", cache_dir=str(tmp_path_factory.mktemp("builtin-moe")))
    runs = [("mesh", {"ep": 2, "dp_shard": 1}, {"activation_checkpointing": "full"})]
    results = spawn_learner_group(2, memory_runs, moe_dir, runs, backend="gloo", timeout_s=600)
    check_runs(runs, results, reference(moe_dir), blocks=2)


REFUSED = [
    ("ddp", None, {"offload": "params"}, "strategy DDP does not shard them"),
    ("fsdp2", None, {"offload": "optimizer"}, "under FSDP2 the parameters are sharded"),
    ("mesh", {"tp": 2, "dp_shard": 1}, {"offload": "params"}, "supported on data-parallel layouts"),
]


def test_fsdp2_offload_and_checkpointing_train_like_one_process_and_offload_is_refused_elsewhere(
        model_dir: str, single: dict) -> None:
    """The default set's representative (one process start): FSDP2 with offloaded
    shards and every block checkpointed trains like one process and like FSDP2 without
    either; offload where the group's strategy cannot take it is a clear error on every
    rank."""
    from memory_workers import runs_and_refusals

    cases = [case[:3] for case in REFUSED]
    results = spawn_learner_group(2, runs_and_refusals, model_dir, FAST_RUNS, cases, backend="gloo", timeout_s=600)
    check_runs(FAST_RUNS, [r["runs"] for r in results], single)
    for rank in results:
        for message, (*_, fragment) in zip(rank["refused"], REFUSED):
            assert fragment in message, message
