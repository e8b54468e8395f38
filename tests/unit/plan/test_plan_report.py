"""The plan's report: the table's cells, the reasons built from the numbers, the config
sections of each kind of layout (and that rltune's loader accepts them), the JSON object,
and ``write_config``'s merge. Plans are built by hand here, with round figures."""

from __future__ import annotations

import yaml
import pytest

from rltune.plan.errors import PlanError

from rltune.config import load_config
from rltune.plan.report import (config_sections, differences, format_table, layout_text, reasons, rejections_text,
                                to_json, write_config)
from rltune.plan.search import PlanResult
from rltune.plan.spec import Candidate, Cluster, LearnerLayout, Plan, RoleMemory, StepTime

APART = Candidate(learner=LearnerLayout(dp_shard=4, tp=2), generator_tp=2, generator_replicas=2, colocate=False,
                  micro_batch_tokens=4096, max_staleness=1, weight_sync="broadcast")
COLOCATED = Candidate(learner=LearnerLayout(dp_shard=8), generator_replicas=8, colocate=True)


def _plan(cand: Candidate, *, decode: float, learn: float, step: float, sps: float) -> Plan:
    t = StepTime(prefill=1.0, decode=decode, forward_backward=learn, comm={"fsdp": 0.5}, weight_sync=0.25, step=step)
    return Plan(candidate=cand, memory={"learner": RoleMemory(weights=40e9, optimizer=20e9),
                                        "generator": RoleMemory(weights=8e9, kv_cache=12e9)},
                time=t, samples_per_s=sps, utilisation={"generator": 0.9, "learner": 0.75})


# APART: generate 1 + 9 = 10 s, learn 6 + 0.5 = 6.5 s, overlapped: max(10, 6.5) + 0.25 = 10.25 s;
# 512 samples / 10.25 s = 49.95/s. COLOCATED in turn: 10 + 6.5 + 0.25 = 16.75 s: 30.57/s
BEST = _plan(APART, decode=9.0, learn=6.0, step=10.25, sps=512 / 10.25)
COLO = _plan(COLOCATED, decode=9.0, learn=6.0, step=16.75, sps=512 / 16.75)
RESULT = PlanResult(plans=(BEST, COLO), rejected={"learner needs # GB per device at dp_shard=#, has #": 7},
                    examples={"learner needs # GB per device at dp_shard=#, has #": "learner needs 94 GB per device at dp_shard=1, has 80"},
                    evaluated=10, suggestions=10, climbed=0, fitting=3, space_size=10, method="exhaustive",
                    alternatives={"apart": BEST, "colocated": COLO, "staleness=1": BEST, "staleness=0": COLO})


def test_layout_text():
    assert layout_text(APART) == "2 gen x tp2 + 8 learn [dp_shard=4 tp=2]"
    assert layout_text(COLOCATED) == "8 colocated [dp_shard=8]"
    assert layout_text(Candidate(learner=LearnerLayout(), colocate=True)) == "1 colocated [one rank]"


def test_table_cells():
    lines = format_table([BEST]).splitlines()
    cells = lines[2].split("  ")
    cells = [c.strip() for c in cells if c.strip()]
    # learner 40 + 20 = 60.0 GB, generator 8 + 12 = 20.0; generate 10.00, learn 6.50, comm 0.50,
    # sync 0.25, step 10.25, 512 / 10.25 = 49.95 samples/s
    assert cells == ["1", "2 gen x tp2 + 8 learn [dp_shard=4 tp=2]", "1", "4096", "none", "none", "broadcast",
                     "60.0", "20.0", "10.00", "6.50", "0.50", "0.25", "10.25", "49.95", "90%", "75%"]


def test_reasons_come_from_the_numbers():
    text = reasons(RESULT)
    # colocated: 30.57/s; 49.95 / 30.57 - 1 = +63 %
    assert "Generators apart: 2 engine(s) of TP 2 on 4 devices, 8 learner devices." in text
    assert "(8 colocated [dp_shard=8]) takes 16.75 s a step, 30.57 samples/s (this plan: +63%)" in text
    assert "max(generate + score 10.00, learn 6.50) + sync 0.25 = 10.25 s" in text
    assert "on-policy (staleness 0) the best plan reaches 30.57 samples/s (this plan: +63%)" in text
    # the largest phase: decode 9 s of 10 + 6.5 + 0.25 = 16.75 s of work: 54 %
    assert "dominated by decode: 9.00 s, 54% of the work of a step" in text
    # runner-up: 30.57 / 49.95 - 1 = -39 %
    assert "The runner-up (dp_shard 4 -> 8, tp 2 -> 1, colocate False -> True" in text
    assert "reaches 30.57 samples/s (-39%)" in text


def test_rejections_text():
    assert rejections_text(RESULT) == ("7 rejected; most common reasons:\n"
                                       "  7 x learner needs 94 GB per device at dp_shard=1, has 80")


def test_differences():
    assert differences(APART, APART) == []
    assert differences(APART, COLOCATED)[:2] == ["dp_shard 4 -> 8", "tp 2 -> 1"]


def test_sections_apart_with_engine_tp():
    s = config_sections(BEST, Cluster(gpus=12))
    assert s["runtime"]["mode"] == "ray"
    assert s["runtime"]["placement"] == {"generators": 2, "learners": 8, "colocate": False,
                                         "learner": {"cpus": 1.0, "gpus": 1.0},
                                         "generator": {"cpus": 1.0, "gpus": 2.0}}  # the layout: train.parallel
    assert s["runtime"]["max_staleness"] == 1 and s["runtime"]["weight_sync"] == "broadcast"
    assert s["algo"] == {"importance_correction": "token-truncate"}
    assert s["rollout"] == {"vllm": {"tensor_parallel_size": 2}}
    assert s["train"]["parallel"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 2, "pp": 1, "ep": 1, "pp_schedule": "1f1b"}
    assert s["train"]["micro_batch_tokens"] == 4096


def test_sections_colocated_and_one_process():
    s = config_sections(COLO, Cluster(gpus=8))
    assert s["runtime"]["placement"]["learner"]["gpus"] == s["runtime"]["placement"]["generator"]["gpus"] == 0.5
    assert "algo" not in s and "rollout" not in s
    one = config_sections(_plan(Candidate(learner=LearnerLayout(), colocate=True), decode=1, learn=1, step=3, sps=1),
                          Cluster(gpus=1, kind="cpu"))
    assert one["runtime"] == {"mode": "local", "max_staleness": 0, "device": "cpu"}  # no Ray placement
    gpu = config_sections(_plan(Candidate(learner=LearnerLayout(), colocate=True), decode=1, learn=1, step=3, sps=1),
                          Cluster(gpus=1))
    assert gpu["runtime"]["device"] == "cuda"  # the plan's GPU, or a clear refusal on a machine without one
    assert "device" not in config_sections(COLO, Cluster(gpus=8))["runtime"]  # Ray actors take placement's GPUs


def test_optimizer_offload_is_written_as_a_ddp_group(tmp_path):
    """A replicated learner with its optimizer state on the host (the only layout the
    search gives ``offload: optimizer``) is a DDP group: no ``train.parallel``, not even
    the input's, since a layout's learner shards its parameters and the offload needs them
    whole. rltune's loader accepts the result."""
    cand = Candidate(learner=LearnerLayout(dp_replicate=2), generator_replicas=2, colocate=True, offload="optimizer")
    plan = _plan(cand, decode=1, learn=1, step=3, sps=1)
    s = config_sections(plan, Cluster(gpus=2))
    assert "parallel" not in s["train"] and s["train"]["offload"] == "optimizer"
    assert s["runtime"]["placement"]["learner_strategy"] == "ddp" and s["runtime"]["placement"]["learners"] == 2
    base = tmp_path / "in.yaml"
    base.write_text(yaml.safe_dump({"name": "x", "model": {"path": "builtin:tiny"},
                                    "train": {"lr": 3e-4, "parallel": {"dp_shard": 2}}}))
    cfg = load_config(write_config(base, plan, tmp_path / "out.yaml", Cluster(gpus=2)))
    assert not cfg.train.parallel.model_fields_set and cfg.train.offload == "optimizer"
    assert cfg.runtime.mode == "ray" and cfg.runtime.placement.learners == 2 and cfg.train.lr == 3e-4


def test_staleness_keeps_a_chosen_correction():
    base = load_config(None, ["algo.importance_correction=seq-mask", "runtime.max_staleness=1"])
    assert "algo" not in config_sections(BEST, Cluster(gpus=12), base)


def test_written_config_merges_and_loads(tmp_path):
    base = tmp_path / "in.yaml"
    base.write_text(yaml.safe_dump({"name": "x", "model": {"path": "builtin:tiny"}, "rollout": {"engine": "vllm"},
                                    "train": {"lr": 3e-4, "parallel": {"tp": 1}}}))
    out = write_config(base, BEST, tmp_path / "out.yaml", Cluster(gpus=12))
    cfg = load_config(out)
    assert cfg.train.lr == 3e-4 and cfg.train.parallel.tp == 2 and cfg.train.parallel.dp_shard == 4
    assert cfg.runtime.placement.generators == 2 and cfg.rollout.vllm.tensor_parallel_size == 2
    assert cfg.algo.importance_correction == "token-truncate" and cfg.runtime.max_staleness == 1


def test_the_input_config_is_never_written_over(tmp_path):
    base = tmp_path / "in.yaml"
    text = "# my notes\nname: x\nmodel: {path: 'builtin:tiny'}\n"
    base.write_text(text)
    (tmp_path / "sub").mkdir()
    with pytest.raises(PlanError, match=r"--write .*in.yaml is the input config: writing it would replace the file"):
        write_config(base, BEST, tmp_path / "sub" / ".." / "in.yaml", Cluster(gpus=12))  # another spelling
    assert base.read_text() == text


def test_a_refused_plan_leaves_an_existing_output_as_it_was(tmp_path, monkeypatch):
    import rltune.plan.report as report

    base = tmp_path / "in.yaml"
    base.write_text(yaml.safe_dump({"name": "x", "model": {"path": "builtin:tiny"}, "train": {"lr": 3e-4}}))
    out = tmp_path / "out.yaml"
    out.write_text("an earlier plan\n")
    # sections rltune's loader refuses once merged (a stand-in for a planner bug)
    monkeypatch.setattr(report, "config_sections", lambda plan, cluster, cfg: {"train": {"steps": -1}})
    with pytest.raises(PlanError, match=rf"the planned config for {out} is refused by rltune \(nothing written\): "
                                        rf"invalid config {out}:"):
        write_config(base, BEST, out, Cluster(gpus=12))
    assert out.read_text() == "an earlier plan\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.yaml", "out.yaml"]


def test_json():
    doc = to_json(RESULT, model="m", params=123, cluster=Cluster(gpus=12))
    assert doc["fits"] and doc["params"] == 123 and doc["gpus"] == 12
    assert doc["memory_gb"] == {"learner": 60.0, "generator": 20.0}
    assert doc["step_s"] == 10.25 and doc["samples_per_s"] == pytest.approx(49.951, abs=1e-3)
    assert doc["layout"]["generators"] == 2 and doc["layout"]["dp_shard"] == 4 and doc["layout"]["generator_gpus"] == 4
    assert [p["samples_per_s"] for p in doc["plans"]] == [BEST.samples_per_s, COLO.samples_per_s]
    assert doc["rejected"] == [{"reason": "learner needs 94 GB per device at dp_shard=1, has 80",
                                "kind": "learner needs # GB per device at dp_shard=#, has #", "count": 7}]
    assert doc["search"]["method"] == "exhaustive" and doc["config"]["runtime"]["mode"] == "ray"


def test_notes_for_the_actors_rltune_adds_on_ray():
    from rltune.plan.report import runtime_notes
    from rltune.plan.spec import Workload

    ppo = Workload(algo="ppo", generates=True, critic=True, reference=True, prompts_per_step=8, group_size=1,
                   prompt_tokens=64, completion_tokens=64)
    (note,) = runtime_notes(BEST, ppo)  # 12 devices planned, + reference + critic = 14
    assert "the reference model and the critic as actor(s) of their own" in note and "needs 14 devices, not 12" in note
    grpo = Workload(algo="grpo", generates=True, critic=False, reference=False, prompts_per_step=8, group_size=4,
                    prompt_tokens=64, completion_tokens=64)
    assert runtime_notes(BEST, grpo) == []
    one = _plan(Candidate(learner=LearnerLayout(), colocate=True), decode=1, learn=1, step=3, sps=1)
    assert runtime_notes(one, ppo) == []  # one process: the local runtime holds them all
