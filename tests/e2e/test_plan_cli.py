"""``rltune plan``: a plan of a built-in tiny model on a one-device CPU cluster is written
into its config, and that config trains through ``rltune train`` unchanged; a plan of
llama-3.1-8b on 8 x 80 GB writes a config whose learner layout passes rltune's own layout
checks; bad input ends with one line and exit status 2; a plain plan loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rltune.cli import main
from rltune.config import load_config
from rltune.parallel.layout import layout_for, layout_problems
from rltune.plan.calibration_file import save_calibration
from rltune.plan.catalogue import CATALOGUE
from rltune.plan.spec import Cluster, Efficiency
from cli_check import fails

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")  # one message, one line


def _tiny_config(tmp_path: Path, reward_file: Path) -> Path:
    data = {
        "name": "plan-tiny",
        "model": {"path": "builtin:tiny"},
        "algo": {"name": "grpo", "group_size": 2},
        "data": {"train": "builtin:arith_small/train", "max_prompt_tokens": 32},
        "reward": [{"fn": f"{reward_file.name}:digit_share"}],  # relative to the config's directory
        "rollout": {"max_new_tokens": 4},
        "train": {"steps": 50, "prompts_per_step": 2, "lr": 1e-3, "threads": 1},
        "log": {"dir": str(tmp_path / "runs"), "console": False},
        "checkpoint": {"final": False},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cpu_calibration(tmp_path: Path, devices: int = 1) -> Path:
    """A calibration file of a small CPU (figures of the order this machine measures)."""
    cluster = Cluster(gpus=devices, gpus_per_node=devices, memory_gb=8.0, tflops=0.1, hbm_gbps=10.0, intra_gbps=10.0,
                      inter_gbps=10.0, host_gbps=10.0, fp32_ratio=1.0, kind="cpu", name="test CPU")
    eff = Efficiency(train_mfu=0.3, prefill_mfu=0.3, decode_mfu=0.2, layer_overhead_s=1e-4)
    return save_calibration(tmp_path / "calibration.json", cluster, eff, fitted=(), machine={"cpu": "test"})


def test_written_tiny_config_trains(tmp_path, digit_reward_file, capsys):
    config = _tiny_config(tmp_path, digit_reward_file)
    out = tmp_path / "planned.yaml"  # beside the input: the reward file's relative path still resolves
    assert main(["plan", str(config), "--calibration", str(_cpu_calibration(tmp_path)), "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 colocated [one rank]" in printed and "mode: local" in printed
    written = yaml.safe_load(out.read_text())
    assert written["runtime"]["mode"] == "local"
    assert written["train"]["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "ep": 1,
                                            "pp_schedule": "1f1b"}
    assert written["reward"] == [{"fn": "my_rewards.py:digit_share"}]  # the rest of the input kept
    assert main(["train", str(out), "train.steps=2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "plan-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows if "loss/total" in row or "reward/mean" in row}) == [1, 2]


def _llama_config(tmp_path: Path, **algo) -> Path:
    data = {
        "name": "llama8b-grpo",
        "model": {"path": "builtin:llama-3.1-8b"},
        "algo": {"name": "grpo", "group_size": 8, **algo},
        "data": {"train": "builtin:arith/train", "max_prompt_tokens": 512},
        "reward": [{"fn": "builtin:exact_numeric"}],
        "rollout": {"engine": "vllm", "max_new_tokens": 1024},
        "train": {"prompts_per_step": 64, "precision": "bf16"},
    }
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_gpu_plan_writes_a_layout_rltune_accepts(tmp_path, capsys):
    out = tmp_path / "planned.yaml"
    argv = ["plan", str(_llama_config(tmp_path)), "--gpus", "8", "--max-staleness", "1", "--write", str(out), "--json"]
    assert main(argv) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["params"] == 8_030_261_248  # Llama 3.1 8B's published 8.03 B
    assert answer["search"]["method"] == "exhaustive" and answer["search"]["evaluated"] > 1000
    cfg = load_config(out)
    layout = answer["layout"]
    assert cfg.runtime.mode == "ray" and cfg.runtime.placement.learners == layout["learners"]
    assert layout["learners"] + layout["generator_gpus"] == 8
    if cfg.runtime.max_staleness > 0:
        assert cfg.algo.importance_correction == "token-truncate"  # added: rltune refuses staleness without it
    spec = CATALOGUE["llama-3.1-8b"]
    hf = SimpleNamespace(model_type="llama", num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                         vocab_size=spec.vocab, num_hidden_layers=spec.layers)
    world = cfg.runtime.placement.learners
    assert layout_problems(layout_for(cfg, world), world, hf) == []
    assert answer["samples_per_s"] == max(p["samples_per_s"] for p in answer["plans"])


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "8", "--cluster", "c.yaml"], "--cluster FILE describes the cluster; drop --gpus"),
    (["--gpus", "0"], "--gpus 0: must be at least 1"),
    (["--gpus", "8", "--top", "0"], "--top 0: must be at least 1"),
    ([], "describe the cluster: --gpus N"),
    (["--gpus", "8", "--out", "x.json"], "--out is where --calibrate saves"),
    (["--gpus", "8", "--score-s", "-0.5"], "--score-s -0.5: must be a finite number of seconds, 0 or more"),
    (["--gpus", "8", "--score-s", "nan"], "--score-s nan: must be a finite number of seconds, 0 or more"),
])
def test_contradictory_flags(tmp_path, capsys, argv, message):
    assert message in fails(capsys, ["plan", str(_llama_config(tmp_path)), *argv])


def test_write_with_calibrate(tmp_path, capsys):
    assert "--calibrate measures this machine and writes --out; it takes no --write" in \
        fails(capsys, ["plan", "--calibrate", "--write", str(tmp_path / "o.yaml")])


def test_score_s_with_calibrate(tmp_path, capsys):
    assert "--calibrate measures this machine and writes --out; it takes no --score-s" in \
        fails(capsys, ["plan", "--calibrate", "--score-s", "0"])  # 0 too: given is given


def _plans(capsys, argv: list[str]) -> list[dict]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["plans"]


@pytest.mark.parametrize("cluster", ["gpus", "calibration"])
def test_score_s_is_the_reward_time_of_every_sample(tmp_path, capsys, digit_reward_file, cluster):
    """``--score-s`` replaces ``Efficiency.score_s`` (0 by default and in the calibration
    file): every plan's scoring phase is it times the step's samples (64 prompts x 8 for
    the Llama config, 2 x 2 for the tiny one), and a colocated plan's step grows by as much."""
    if cluster == "gpus":
        argv, samples = ["plan", str(_llama_config(tmp_path)), "--gpus", "8", "--json"], 64 * 8
    else:
        argv, samples = ["plan", str(_tiny_config(tmp_path, digit_reward_file)), "--calibration",
                         str(_cpu_calibration(tmp_path)), "--json"], 2 * 2
    plain, scored = _plans(capsys, argv), _plans(capsys, [*argv, "--score-s", "0.01"])
    assert all(p["time_s"]["score"] == 0.0 for p in plain)
    assert scored and all(p["time_s"]["score"] == pytest.approx(0.01 * samples, rel=1e-12) for p in scored)
    # the config's staleness is 0, so every plan is synchronous and nothing hides the scoring
    assert all(p["layout"]["max_staleness"] == 0 for p in plain + scored)
    steps = {json.dumps(p["layout"], sort_keys=True): p["step_s"] for p in plain}
    compared = [(p["step_s"], steps[key]) for p in scored if (key := json.dumps(p["layout"], sort_keys=True)) in steps]
    assert compared
    for after, before in compared:
        assert after == pytest.approx(before + 0.01 * samples, rel=1e-9)


def test_unknown_model_lists_the_catalogue(tmp_path, capsys):
    config = _llama_config(tmp_path)
    config.write_text(config.read_text().replace("builtin:llama-3.1-8b", "builtin:llama-9"))
    message = fails(capsys, ["plan", str(config), "--gpus", "8"])
    assert "unknown model 'builtin:llama-9'" in message and "builtin:llama-3.1-70b" in message


def test_cluster_too_small_says_how_many_devices(tmp_path, capsys):
    config = _llama_config(tmp_path)
    config.write_text(config.read_text().replace("llama-3.1-8b", "llama-3.1-70b"))
    # one device offloads nothing; from two, FSDP2's params offload holds the states on the host
    message = fails(capsys, ["plan", str(config), "--gpus", "1"])
    assert "llama-3.1-70b does not fit 1 device(s) of 80 GB at any layout" in message
    assert "its learner alone needs at least 2 such devices" in message
    # where the learner alone could fit, the error names the most common reason instead
    message = fails(capsys, ["plan", str(config), "--gpus", "2"])
    assert "no layout of llama-3.1-70b fits 2 device(s) of 80 GB" in message and "most common reason" in message


def test_missing_config_file(tmp_path, capsys):
    assert "config file not found" in fails(capsys, ["plan", str(tmp_path / "nope.yaml"), "--gpus", "8"])


NO_TORCH = '''
import sys, types
registry = types.ModuleType("rltune.algos.registry")  # the algorithm registry holds the losses (torch)
registry.ALGORITHMS = {"grpo": types.SimpleNamespace(online=True, needs_critic=False, pairs=False,
                                                     requires_reference=lambda kl: kl > 0)}
sys.modules["rltune.algos.registry"] = registry
from rltune.cli import main
code = main(["plan", sys.argv[1], "--gpus", "8", "--json"])
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
'''


def test_a_plain_plan_loads_no_torch(tmp_path):
    # the algorithm registry (rltune.algos, which holds the loss functions) is the one module
    # of the plan's path that imports torch; with its entries given, the rest must not
    done = subprocess.run([sys.executable, "-c", NO_TORCH, str(_llama_config(tmp_path))], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH 0", done.stdout[-2000:] + done.stderr[-2000:]


def test_no_layout_fits_with_the_hf_engine_says_why(tmp_path, capsys):
    # llama-3.1-70b's learner fits 32 devices, but the hf engine holds the whole model (141 GB
    # of bf16 weights) on one generator device of 80 GB
    config = _llama_config(tmp_path)
    config.write_text(config.read_text().replace("llama-3.1-8b", "llama-3.1-70b").replace("engine: vllm", "engine: hf"))
    message = fails(capsys, ["plan", str(config), "--gpus", "32"])
    assert "no layout of llama-3.1-70b fits 32 device(s) of 80 GB (all" in message
    assert "generator needs" in message and "rollout.engine: vllm lets the plan split it" in message
