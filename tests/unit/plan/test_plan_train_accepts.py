"""What ``rltune plan`` writes, ``rltune train`` accepts: the search leaves out the learner
layouts that rltune's own layout checks (``rltune.parallel.layout.run_layout``) and
config checks would refuse, says what it left out and why, and refuses a precision the
devices cannot run. Also the one-line errors for a malformed cluster file, model config
or output path, where there were tracebacks."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml
from rich.console import Console

from rltune.config import load_config
from rltune.learner.precision import check_precision
from rltune.parallel.layout import run_layout
from rltune.plan.catalogue import load_model_spec, tp_counts
from rltune.plan.cluster import PRESETS, cluster_from_args, load_cluster
from rltune.plan.command import add_arguments, cmd_plan, flag_problems
from rltune.plan.errors import PlanError
from rltune.plan.report import config_sections
from rltune.plan.search import default_space, learner_layouts
from rltune.plan.spec import Candidate, Cluster, LearnerLayout, Plan, RoleMemory, StepTime
from rltune.plan.workload import refused_degrees, workload_from_config

from plan_fixtures import SMALL, SMALL_MOE, grpo

MIXTRAL = {"model_type": "mixtral", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 2048, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2}
"""A small Mixtral-shaped model; its config.json leaves ``router_aux_loss_coef`` at
transformers' default (0.001), which pipeline stages cannot add."""


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _experiment(tmp_path, shape: dict, **sections) -> str:
    """A GRPO experiment on a model of ``shape`` (its config.json), in a directory of its own."""
    tmp_path = tmp_path / f"e{len(list(tmp_path.glob('e*')))}"
    model_dir = tmp_path / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(shape))
    cfg = {"name": "x", "model": {"path": str(model_dir)}, "algo": {"name": "grpo", "group_size": 8},
           "data": {"max_prompt_tokens": 512}, "rollout": {"engine": "vllm", "max_new_tokens": 1024},
           "train": {"prompts_per_step": 64, "precision": "bf16"}, "reward": [{"fn": "m:f"}]}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _plan_and_train_layout(path: str, out, *flags: str):
    """Plan ``path`` and write the best plan to ``out``; the checks ``rltune train`` runs
    on it before loading the model raise for a layout or precision it refuses."""
    assert cmd_plan(_args(path, *flags, "--write", str(out)), Console(quiet=True)) == 0
    cfg = load_config(out)
    layout = run_layout(cfg)
    check_precision(cfg, layout)
    return cfg, layout


def test_an_moe_models_router_loss_keeps_pipeline_stages_out(tmp_path):
    path = _experiment(tmp_path, MIXTRAL)
    cfg = load_config(path)
    spec = load_model_spec(cfg.model.path)
    assert spec.router_aux_loss_coef == 0.001  # transformers' default, absent from config.json
    refused = refused_degrees(cfg, spec)
    assert list(refused) == ["pp"] and "load-balancing loss (coefficient 0.001" in refused["pp"]
    space = default_space(spec, workload_from_config(cfg), Cluster(gpus=32), refused=refused)
    assert space.pp == (1,) and space.notes[0].startswith("train.parallel pp > 1 not searched: train.parallel.pp")
    written, layout = _plan_and_train_layout(path, tmp_path / "out.yaml", "--gpus", "32")
    assert layout.pp == 1 and written.runtime.placement.learners == layout.world
    # without the loss, pipeline stages are searched again
    cfg0 = load_config(path, ["model.router_aux_loss_coef=0"])
    assert refused_degrees(cfg0, spec) == {}


def test_tensor_parallelism_divides_the_mlp_width_too(tmp_path):
    odd = {"model_type": "qwen2", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 2050, "vocab_size": 32000}
    path = _experiment(tmp_path, odd)
    spec = load_model_spec(load_config(path).model.path)
    assert tp_counts(spec) == (8, 8, 32000, 2050)
    space = default_space(spec, grpo(), Cluster(gpus=16))
    assert {lay.tp for lay in learner_layouts(spec, 16, Cluster(gpus=16), space)} == {1, 2}
    # an MoE model's routed experts are replicated over tp: only heads and vocabulary count
    assert tp_counts(SMALL_MOE) == (8, 4, 32000) and tp_counts(SMALL) == (8, 4, 32000, 4096)
    _, layout = _plan_and_train_layout(path, tmp_path / "out.yaml", "--gpus", "16")
    assert layout.tp in (1, 2)


def test_train_compile_keeps_the_sharded_degrees_out(tmp_path):
    path = _experiment(tmp_path, MIXTRAL, train={"compile": True}, model={"router_aux_loss_coef": 0})
    cfg = load_config(path)
    spec = load_model_spec(cfg.model.path)
    # and on an MoE model checkpointing with it (refused by the learner once the model is loaded)
    assert set(refused_degrees(cfg, spec)) == {"tp", "pp", "ep", "activation_checkpointing"}
    space = default_space(spec, workload_from_config(cfg), Cluster(gpus=8), refused=refused_degrees(cfg, spec))
    assert space.activation_checkpointing == ("none",) and space.notes == (
        "train.parallel tp, pp, ep > 1 not searched: train.compile compiles whole transformer blocks on plain "
        "tensors, not on tp, pp or ep shards",
        "train.activation_checkpointing full or selective not searched: train.compile with activation "
        "checkpointing is refused for a mixture-of-experts model")
    dense = load_config(_experiment(tmp_path, {**MIXTRAL, "model_type": "llama"}, train={"compile": True}))
    assert set(refused_degrees(dense, load_model_spec(dense.model.path))) == {"tp", "pp"}  # no experts to split
    written, layout = _plan_and_train_layout(path, tmp_path / "out.yaml", "--gpus", "8")
    assert layout.tp == layout.pp == layout.ep == 1 and written.train.compile
    assert written.train.activation_checkpointing == "none"


def test_fp16_keeps_pipeline_stages_out(tmp_path):
    path = _experiment(tmp_path, {**MIXTRAL, "model_type": "llama"}, train={"precision": "fp16"})
    cfg = load_config(path)
    refused = refused_degrees(cfg, load_model_spec(cfg.model.path))
    assert list(refused) == ["pp"] and "the pipeline schedule runs the backward itself" in refused["pp"]
    _, layout = _plan_and_train_layout(path, tmp_path / "out.yaml", "--gpus", "16")
    assert layout.pp == 1


def test_a_cpu_cluster_plans_no_offload():
    cpu = Cluster(gpus=2, memory_gb=12, kind="cpu", name="this CPU", fp8=False)
    assert default_space(SMALL, grpo(), cpu).offload == ("none",)
    assert len(default_space(SMALL, grpo(), Cluster(gpus=2)).offload) == 3


def test_the_inputs_sequence_parallel_stays_only_where_the_plan_has_tp(tmp_path):
    base = load_config(_experiment(tmp_path, MIXTRAL, train={"parallel": {"tp": 2, "sequence_parallel": True}}))
    plain = load_config(_experiment(tmp_path, MIXTRAL))

    def sections(layout: LearnerLayout, cfg) -> dict:
        plan = Plan(candidate=Candidate(learner=layout, generator_replicas=1),
                    memory={"learner": RoleMemory(), "generator": RoleMemory()}, time=StepTime(step=1.0),
                    samples_per_s=1.0)
        return config_sections(plan, Cluster(gpus=layout.world + 1), cfg)["train"]["parallel"]

    assert sections(LearnerLayout(dp_shard=2), base)["sequence_parallel"] is False
    assert sections(LearnerLayout(tp=2, pp=2), base)["sequence_parallel"] is False
    assert sections(LearnerLayout(tp=2), base)["sequence_parallel"] is True
    assert "sequence_parallel" not in sections(LearnerLayout(tp=2), plain)


def test_fp8_is_refused_on_devices_without_float8_matmuls():
    work = grpo(precision="fp8")
    for preset in ("h100-80gb", "h200-141gb", "b200-192gb"):
        default_space(SMALL, work, cluster_from_args(8, preset=preset))
    with pytest.raises(PlanError, match=r"^train.precision fp8 needs float8 matmuls .* A100 SXM 80GB does not have"):
        default_space(SMALL, work, cluster_from_args(8, preset="a100-80gb"))
    with pytest.raises(PlanError, match="train.precision fp8 needs float8 matmuls"):
        default_space(SMALL, work, Cluster(gpus=2, kind="cpu", name="this CPU", fp8=False))
    assert not PRESETS["a100-80gb"].fp8


@pytest.mark.parametrize(("text", "message"), [
    ("gpus: 8\npreset: [a]\n", r"unknown device preset \['a'\]"),
    ("gpus: 8\ngpus: 16\n", "duplicate key 'gpus'"),
])
def test_a_malformed_cluster_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=message):
        load_cluster(path)


def test_an_empty_preset_is_the_default_device(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("gpus: 8\npreset:\n")
    assert load_cluster(path).name == PRESETS["h100-80gb"].name


@pytest.mark.parametrize(("key", "value", "message"), [
    ("mlp_only_layers", 5, "`mlp_only_layers` is 5, expected a list of layer indices"),
    ("mlp_only_layers", [[0]], r"`mlp_only_layers` is \[\[0\]\], expected a list of layer indices"),
    ("tie_word_embeddings", "false", "`tie_word_embeddings` is 'false', expected true or false"),
    ("router_aux_loss_coef", "big", "`router_aux_loss_coef` is 'big', expected a number >= 0"),
    ("mlp_only_layers", [0, 7], r"`mlp_only_layers` \[0, 7\] names layers outside the 2 layers \(0 .. 1\)"),
])
def test_a_malformed_model_config_is_one_line(tmp_path, key, value, message):
    moe = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
           key: value}
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(PlanError, match=message):
        load_model_spec(str(tmp_path / "config.json"))


def test_output_paths_are_checked_before_any_work(tmp_path):
    assert flag_problems(_args("c.yaml", "--gpus", "8", "--write", "")) == ["--write '.': give a file name"]
    assert flag_problems(_args("c.yaml", "--gpus", "8", "--write", str(tmp_path))) == [
        f"--write {tmp_path}: is a directory; give the path of a file"]
    assert flag_problems(_args("c.yaml", "--gpus", "8", "--write", str(tmp_path / "no" / "out.yaml"))) == [
        f"--write {tmp_path / 'no' / 'out.yaml'}: its directory {tmp_path / 'no'} does not exist"]
    assert flag_problems(_args("--calibrate", "--out", str(tmp_path))) == [
        f"--out {tmp_path}: is a directory; give the path of a file"]
    assert flag_problems(_args("--calibrate", "--out", str(tmp_path / "new" / "cal.json"))) == []  # made there
    assert flag_problems(_args("c.yaml", "--calibrate")) == [
        "--calibrate measures this machine and writes --out; it takes no CONFIG.yaml"]
