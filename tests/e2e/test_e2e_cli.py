"""What a user sees from ``rltune train``: a wrong config, data file, reward or model path
ends with one message naming what to fix and exit code 2, never a traceback; reward
functions that fail on some samples do not stop the run and are never scored 0; a good
run leaves its resolved config, metrics and samples in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import rltune.runtime.roles
from rltune.cli import main
from rltune.config import load_config
from rltune.rollout.vllm import vllm_missing
from cli_check import fails

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

FLAKY_REWARD = '''
CALLS = [0]


def flaky(prompt, completion, **meta):
    """Every third call raises, the one after it gives no score, the rest score."""
    CALLS[0] += 1
    if CALLS[0] % 3 == 0:
        raise ValueError("cannot parse the completion")
    if CALLS[0] % 3 == 1:
        return None
    return 0.25 + sum(ch.isdigit() for ch in completion)
'''

GOOD_ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"},
             {"prompt": "4+4=", "answer": "8"}]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Rich wraps at the terminal width (80 without a terminal); a wide one keeps each
    message, paths included, on one line for the assertions."""
    monkeypatch.setenv("COLUMNS", "500")


@pytest.fixture
def config_file(tmp_path: Path, digit_reward_file: Path):
    """``write(edit=None) -> path``: a tiny GRPO config file next to its reward file
    (``my_rewards.py``); ``edit(dict)`` changes the YAML content before it is written."""
    assert digit_reward_file.parent == tmp_path

    def write(edit=None) -> Path:
        data = {
            "name": "cli-run",
            "model": {"path": "builtin:tiny"},
            "algo": {"name": "grpo", "group_size": 2},
            "data": {"train": "builtin:arith_small/train"},
            "reward": [{"fn": f"{digit_reward_file.name}:digit_share"}],  # relative to this file
            "rollout": {"max_new_tokens": 4},
            "train": {"steps": 2, "prompts_per_step": 2, "lr": 1e-3, "threads": 1},
            "log": {"dir": str(tmp_path / "runs"), "console": False},
            "checkpoint": {"final": False},
        }
        if edit is not None:
            edit(data)
        path = tmp_path / "experiment.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model's weights are loaded: a wrong input must be reported
    before the expensive part of the start-up."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input error was reported")

    monkeypatch.setattr(rltune.runtime.roles, "load_model", load_model)


def _succeeds(capsys, argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    return err


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------- config


def test_typo_in_a_section_name(capsys, config_file):
    path = config_file(lambda d: d.__setitem__("trian", d.pop("train")))
    err = fails(capsys, ["train", str(path)])
    assert str(path) in err
    assert "unknown key `trian`; did you mean `train`?" in err


def test_typo_in_a_nested_key(capsys, config_file):
    path = config_file(lambda d: d["train"].__setitem__("lrr", d["train"].pop("lr")))
    err = fails(capsys, ["train", str(path)])
    assert "unknown key `train.lrr`; did you mean `train.lr`?" in err


def test_bad_override_value(capsys, config_file):
    err = fails(capsys, ["train", str(config_file()), "train.steps=-1"])
    assert "train.steps: must be >= 0 (got -1)" in err
    assert "set by override `train.steps=-1`" in err


def test_missing_config_file(capsys, tmp_path):
    err = fails(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert f"config file not found: {tmp_path / 'nope.yaml'}" in err


# --------------------------------------------------------------------------- data


def test_bad_row_names_the_file_and_row(capsys, config_file, tmp_path, no_model_load):
    rows = GOOD_ROWS[:2] + [{"question": "5+5=", "answer": "10"}] + GOOD_ROWS[2:]
    data = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    err = fails(capsys, ["train", str(config_file()), f"data.train={data}"])
    assert f"{data}: row 3:" in err
    assert "'prompt'" in err and "data.on_bad_row=skip" in err


def test_empty_prompt_names_the_file_and_row(capsys, config_file, tmp_path, no_model_load):
    rows = GOOD_ROWS[:1] + [{"prompt": "", "answer": "0"}] + GOOD_ROWS[1:]
    data = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    err = fails(capsys, ["train", str(config_file()), f"data.train={data}"])
    assert f"{data}: row 2:" in err and "empty" in err


def test_bad_rows_skipped_when_asked(capsys, config_file, tmp_path):
    rows = GOOD_ROWS[:1] + [{"prompt": ""}] + GOOD_ROWS[1:2] + [{"question": "5+5="}] + GOOD_ROWS[2:]
    data = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    err = _succeeds(capsys, ["train", str(config_file()), f"data.train={data}", "data.on_bad_row=skip"])
    assert f"data: skipped 2 bad rows of {data}; first: {data}: row 2:" in " ".join(err.split())
    samples = _jsonl(tmp_path / "runs" / "cli-run" / "samples.jsonl")
    assert {s["prompt"] for s in samples} <= {r["prompt"] for r in GOOD_ROWS}
    assert len(samples) == 2 * 2 * 2  # steps x prompts x group


# --------------------------------------------------------------------------- rewards


def test_failing_reward_is_counted_never_scored_zero(capsys, config_file, tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    _succeeds(capsys, ["train", str(config_file()), f"reward.0.fn={tmp_path / 'flaky.py'}:flaky"])
    run_dir = tmp_path / "runs" / "cli-run"
    metrics = [m for m in _jsonl(run_dir / "metrics.jsonl") if "reward/errors" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    # calls 1..8 (4 samples a step): None, score, raise, None | score, raise, None, score
    assert [m["reward/errors"] for m in metrics] == [3.0, 2.0]
    samples = _jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 8
    failed = [s for s in samples if s["reward_error"] is not None]
    scored = [s for s in samples if s["reward_error"] is None]
    assert sorted(s["reward_error"] for s in failed) == (
        ["flaky: ValueError: cannot parse the completion"] * 2 + ["flaky: returned None"] * 3
    )
    assert all(s["reward"] is None and s["rewards"] == {"flaky": None} for s in failed)
    assert len(scored) == 3
    assert all(s["reward"] == s["rewards"]["flaky"] >= 0.25 for s in scored)


def test_reward_file_not_found(capsys, config_file, no_model_load):
    err = fails(capsys, ["train", str(config_file()), "reward.0.fn=missing_rewards.py:digit_share"])
    assert "reward spec 'missing_rewards.py:digit_share': file not found" in err


def test_reward_function_not_found(capsys, config_file, no_model_load):
    err = fails(capsys, ["train", str(config_file()), "reward.0.fn=my_rewards.py:digit_shares"])
    assert "reward spec 'my_rewards.py:digit_shares'" in err
    assert "no attribute 'digit_shares'" in err and "digit_share" in err


# --------------------------------------------------------------------------- model


def test_model_path_that_does_not_exist(capsys, config_file, tmp_path, no_model_load):
    missing = tmp_path / "no-such-model"
    err = fails(capsys, ["train", str(config_file()), f"model.path={missing}"])
    assert f"model path {missing} does not exist" in err and "model.path" in err


# --------------------------------------------------------------------------- resume


def test_resume_with_another_seed(capsys, config_file, tmp_path):
    path = config_file()
    _succeeds(capsys, ["train", str(path)])
    err = fails(capsys, ["train", str(path), "checkpoint.resume=auto", "train.steps=3", "train.seed=1"])
    saved = tmp_path / "runs" / "cli-run" / "config.yaml"
    assert f"checkpoint.resume=auto: this config differs from the run's ({saved}) in what the run means: " in err
    assert "train.seed: 0 -> 1;" in err and "train.steps" not in err  # a longer run is the same run


def test_resume_without_the_runs_config_file_is_checked_against_the_checkpoint(capsys, config_file, tmp_path):
    """The checkpoint records what its run means: deleting (or editing) the run's
    config.yaml does not let a resume change it, neither with ``auto`` nor with a path."""
    path = config_file()
    _succeeds(capsys, ["train", str(path)])
    run_dir = tmp_path / "runs" / "cli-run"
    (run_dir / "config.yaml").unlink()
    step = run_dir / "checkpoints" / "step-2"
    err = fails(capsys, ["train", str(path), "checkpoint.resume=auto", "train.steps=3", "train.lr=0.5"])
    assert (f"checkpoint.resume=auto: this config differs from the one recorded in checkpoint {step} "
            "in what the run means: train.lr: ") in " ".join(err.split())
    err = fails(capsys, ["train", str(path), f"checkpoint.resume={step}", "train.steps=3", "train.seed=1",
                         "name=continued"])
    assert "differs from the one recorded in checkpoint" in err and "train.seed: 0 -> 1" in err
    # the same meaning resumes
    _succeeds(capsys, ["train", str(path), "checkpoint.resume=auto", "train.steps=3"])
    assert [m["step"] for m in _jsonl(run_dir / "metrics.jsonl")][-1] == 3


def test_a_resume_with_an_unreadable_metrics_line_changes_no_file(capsys, config_file, tmp_path):
    """Both files are checked before either is cut back to the checkpoint's step."""
    path = config_file()
    _succeeds(capsys, ["train", str(path)])
    run_dir = tmp_path / "runs" / "cli-run"
    metrics, samples = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
    metrics.write_bytes(b"[1]\n" + metrics.read_bytes())
    samples.write_bytes(samples.read_bytes() + b'{"step": 5}\n')  # after the checkpoint: a resume would cut it
    before = (metrics.read_bytes(), samples.read_bytes())
    err = fails(capsys, ["train", str(path), "checkpoint.resume=auto", "train.steps=3"])
    assert f"{metrics}:1: expected a JSON object" in " ".join(err.split())
    assert (metrics.read_bytes(), samples.read_bytes()) == before


def test_more_new_tokens_than_the_model_has_positions_is_refused(capsys, config_file):
    # the tiny model has 512 positions; 100000 new tokens used to exhaust memory in the decoder's cache
    err = " ".join(fails(capsys, ["train", str(config_file()), "rollout.max_new_tokens=100000"]).split())
    assert "rollout.max_new_tokens=100000 after prompts of up to " in err
    assert "but the model has 512 (max_position_embeddings in " in err


def test_a_step_whose_every_episode_failed_learns_nothing_and_the_run_goes_on(capsys, config_file, tmp_path):
    """An environment whose reset fails for every episode leaves rows without a completion
    token: the step is an empty batch (counted), not a crash in the learner."""
    (tmp_path / "bad_env.py").write_text(
        "class BadReset:\n    def reset(self, prompt):\n        raise RuntimeError('backend down')\n"
        "    def step(self, action):\n        raise AssertionError('never reached')\n")
    _succeeds(capsys, ["train", str(config_file()), f"env.name={tmp_path / 'bad_env.py'}:BadReset", "reward=[]",
                       "train.max_reward_error_steps=0"])
    metrics = _jsonl(tmp_path / "runs" / "cli-run" / "metrics.jsonl")
    assert [m["learn/empty_batch"] for m in metrics] == [1.0, 1.0]


# --------------------------------------------------------------------------- a good run


def test_successful_run_writes_its_files(capsys, config_file, tmp_path):
    path = config_file()
    err = _succeeds(capsys, ["train", str(path), "train.steps=2", "name=good", "train.seed=3"])
    run_dir = tmp_path / "runs" / "good"
    assert f"run directory: {run_dir}" in err

    resolved = load_config(run_dir / "config.yaml")
    assert resolved == load_config(path, ["train.steps=2", "name=good", "train.seed=3"])
    assert resolved.train.steps == 2 and resolved.train.seed == 3

    metrics = _jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)

    samples = _jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 2 * 2 * 2  # steps x prompts x group
    for s in samples:
        assert s["prompt"] and isinstance(s["completion"], str)
        digits = sum(ch.isdigit() for ch in s["completion"])
        expected = digits / len(s["completion"]) if s["completion"] else 0.0
        assert s["rewards"] == {"digit_share": pytest.approx(expected, abs=1e-12)}
        assert s["reward"] == s["rewards"]["digit_share"]


@pytest.mark.skipif(vllm_missing() is None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_says_how_to_install_it(capsys, config_file):
    # the message's brackets (an extra's name) reach the terminal as written
    err = fails(capsys, ["train", str(config_file()), "rollout.engine=vllm"])
    assert "rollout.engine=vllm: vLLM is not installed" in err
    assert "pip install 'rltune[vllm]'" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the local runtime trains on this machine's GPU")
def test_optimizer_offload_on_a_cpu_learner_is_refused_before_the_model_loads(capsys, config_file, no_model_load):
    """A local run on a machine without a GPU trains on the CPU, where AdamW's state is in
    host memory already: refused with the fix before any weight is read, whether the
    config says so (``runtime.device: cpu``) or the machine does (``auto``)."""
    err = fails(capsys, ["train", str(config_file()), "train.offload=optimizer"])
    assert "train.offload: optimizer" in err and "this local run trains on the CPU" in err
    assert "train.offload: none" in err
    err = fails(capsys, ["train", str(config_file()), "train.offload=optimizer", "runtime.device=cpu"])
    assert "runtime.device: cpu trains on the CPU" in err and "train.offload: none" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_cuda_device_is_one_message(capsys, config_file, no_model_load):
    err = fails(capsys, ["train", str(config_file()), "runtime.device=cuda"])
    assert "runtime.device=cuda" in err and "sees no CUDA device" in err and "runtime.device: cpu" in err


def test_a_memory_setting_the_model_cannot_take_is_one_message(capsys, config_file):
    """Refused when the learner is built (the model decides it: checkpointing with
    train.compile on a mixture-of-experts model): one message, no traceback."""
    err = fails(capsys, ["train", str(config_file()), "model.path=builtin:tiny-moe",
                         "train.activation_checkpointing=full", "train.compile=true"])
    assert "mixture-of-experts" in err and "turn one of the two off" in err


def test_a_missing_critic_path_names_its_own_key(capsys, config_file, tmp_path):
    err = fails(capsys, ["train", str(config_file()), "algo.name=ppo", f"model.critic_path={tmp_path / 'none'}"])
    assert err.startswith("error: model.critic_path: model path") and "set `model.critic_path` to" in err
