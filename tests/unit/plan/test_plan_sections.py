"""The config sections a plan writes hold only keys the planned runtime reads: no
``runtime.placement.learner_strategy`` beside a ``train.parallel`` layout (the layout's
degrees decide, the strategy is not read), and none of Ray's keys (placement, weight
sync, restarts, the cluster's address) in a one-device (local) plan; ``write_config`` drops the input's keys of those kinds too."""

from __future__ import annotations

import yaml

from rltune.algos import ALGORITHMS
from rltune.config import load_config
from rltune.plan.report import config_sections, write_config
from rltune.plan.spec import Candidate, Cluster, LearnerLayout, Plan, RoleMemory, StepTime
from rltune.runtime.build import setting_problems

SHARDED = Candidate(learner=LearnerLayout(dp_shard=4, tp=2), generator_tp=2, generator_replicas=2, colocate=False,
                    micro_batch_tokens=4096)
ONE = Candidate(learner=LearnerLayout(), colocate=True)
DDP_OFFLOAD = Candidate(learner=LearnerLayout(dp_replicate=2), generator_replicas=2, colocate=True, offload="optimizer")


def _plan(cand: Candidate) -> Plan:
    return Plan(candidate=cand, memory={"learner": RoleMemory(weights=1e9), "generator": RoleMemory(weights=1e9)},
                time=StepTime(decode=1.0, forward_backward=1.0, step=2.0), samples_per_s=1.0)


def _base(tmp_path, **sections) -> object:
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "model": {"path": "builtin:tiny"}, **sections}))
    return path


def test_a_layout_is_written_without_a_learner_strategy():
    s = config_sections(_plan(SHARDED), Cluster(gpus=12))
    assert s["train"]["parallel"]["dp_shard"] == 4
    assert "learner_strategy" not in s["runtime"]["placement"]


def test_a_ddp_learner_without_a_layout_keeps_its_strategy():
    s = config_sections(_plan(DDP_OFFLOAD), Cluster(gpus=2))
    assert "parallel" not in s["train"] and s["runtime"]["placement"]["learner_strategy"] == "ddp"


def test_one_device_is_local_without_ray_keys():
    s = config_sections(_plan(ONE), Cluster(gpus=1))
    assert s["runtime"] == {"mode": "local", "max_staleness": 0, "device": "cuda"}


def test_written_layout_drops_the_inputs_strategy(tmp_path):
    base = _base(tmp_path, rollout={"engine": "vllm"},
                 runtime={"mode": "ray", "placement": {"learners": 2, "learner_strategy": "fsdp2"}})
    out = write_config(base, _plan(SHARDED), tmp_path / "out.yaml", Cluster(gpus=12))
    written = yaml.safe_load(out.read_text())
    assert "learner_strategy" not in written["runtime"]["placement"]
    assert written["train"]["parallel"]["tp"] == 2 and load_config(out).runtime.placement.learners == 8


def test_written_local_plan_drops_the_inputs_ray_keys(tmp_path):
    base = _base(tmp_path, runtime={"mode": "ray", "weight_sync": "broadcast", "ray_address": "auto",
                                    "actor_restarts": 5, "learner_restarts": 0, "reward_workers": 2,
                                    "placement": {"learners": 4, "learner_strategy": "fsdp2"}})
    out = write_config(base, _plan(ONE), tmp_path / "out.yaml", Cluster(gpus=1, kind="cpu"))
    written = yaml.safe_load(out.read_text())
    # the keys a local run reads stay (reward_workers); Ray's go, which it would refuse
    assert written["runtime"] == {"mode": "local", "max_staleness": 0, "device": "cpu", "reward_workers": 2}
    cfg = load_config(out)
    assert cfg.runtime.mode == "local" and not cfg.runtime.placement.model_fields_set
    assert setting_problems(ALGORITHMS[cfg.algo.name], cfg) == []


def test_written_ray_plan_drops_the_inputs_local_device(tmp_path):
    base = _base(tmp_path, rollout={"engine": "vllm"}, runtime={"device": "cuda"})
    out = write_config(base, _plan(SHARDED), tmp_path / "out.yaml", Cluster(gpus=12))
    cfg = load_config(out)  # runtime.device: cuda with mode: ray would be refused
    assert cfg.runtime.mode == "ray" and cfg.runtime.device == "auto"


def test_lora_on_ray_is_searched_and_written_as_a_ddp_group(tmp_path):
    """rltune writes a LoRA checkpoint only from a replicated learner group without
    ``train.parallel`` (any key there makes a mesh, whose checkpoints are sharded): the
    search offers LoRA on Ray that layout alone, and the plan writes it as
    ``learner_strategy: ddp``, dropping the input's ``train.parallel``; ``run_layout``
    (what ``rltune train`` checks before any model loads) accepts the result."""
    from rltune.parallel.layout import run_layout
    from rltune.plan.search import default_space, learner_layouts

    from plan_fixtures import SMALL, grpo

    cluster = Cluster(gpus=8)
    space = default_space(SMALL, grpo(lora_rank=8), cluster)
    assert list(learner_layouts(SMALL, 6, cluster, space)) == [LearnerLayout(dp_replicate=6)]
    assert len(list(learner_layouts(SMALL, 6, cluster, default_space(SMALL, grpo(), cluster)))) > 1
    assert not default_space(SMALL, grpo(lora_rank=8), Cluster(gpus=1)).replicated_only  # one process

    base = _base(tmp_path, model={"path": "builtin:tiny", "lora": {"r": 4}}, train={"parallel": {"dp_replicate": 2}})
    replicated = Candidate(learner=LearnerLayout(dp_replicate=8), generator_replicas=8, colocate=True)
    s = config_sections(_plan(replicated), cluster, load_config(base))
    assert "parallel" not in s["train"] and s["runtime"]["placement"]["learner_strategy"] == "ddp"
    cfg = load_config(write_config(base, _plan(replicated), tmp_path / "out.yaml", cluster))
    assert not cfg.train.parallel.model_fields_set and cfg.runtime.placement.learner_strategy == "ddp"
    assert run_layout(cfg).dp_replicate == 8
