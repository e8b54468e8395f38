"""Reward errors reach the console: the first message of each kind once, the error count
on the progress line, a warning on each step where no sample scored, and a stop (exit 2,
one message) after ``train.max_reward_error_steps`` such steps in a row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rltune.cli import main

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

REWARDS = '''
import math

CALLS = [0]


def high(prompt, completion, **meta):
    return "high"


def nan(prompt, completion, **meta):
    return math.nan


def some(prompt, completion, **meta):
    """Calls 1, 5, 9, ... raise; calls 3, 7, ... return None; the rest score 1."""
    CALLS[0] += 1
    if CALLS[0] % 4 == 1:
        raise ValueError(f"cannot parse call {CALLS[0]}")
    if CALLS[0] % 4 == 3:
        return None
    return 1.0
'''


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Rich wraps at the terminal width; a wide one keeps each message on one line."""
    monkeypatch.setenv("COLUMNS", "1000")


def _train(capsys, tmp_path: Path, reward: str, *overrides: str) -> tuple[int, str, Path]:
    """A 5-step GRPO run (2 prompts x 2 samples a step) with ``rewards.py:REWARD``;
    returns the exit code, everything printed, and the run directory."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = {
        "name": "rewards", "model": {"path": "builtin:tiny"},
        "algo": {"name": "grpo", "group_size": 2}, "data": {"train": "builtin:arith_small/train"},
        "reward": [{"fn": f"rewards.py:{reward}"}], "rollout": {"max_new_tokens": 4},
        "train": {"steps": 5, "prompts_per_step": 2, "threads": 1},
        "log": {"dir": str(tmp_path / "runs")}, "checkpoint": {"final": False},
    }
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    code = main(["train", str(path), *overrides])
    out, err = capsys.readouterr()
    return code, out + err, tmp_path / "runs" / "rewards"


def _steps(path: Path) -> list[int]:
    return sorted({json.loads(line)["step"] for line in path.read_text().splitlines()})


@pytest.mark.parametrize(("reward", "message"), [
    ("high", "high: returned str 'high' (expected a finite number)"),
    ("nan", "nan: returned float nan (expected a finite number)"),
])
def test_a_reward_failing_on_every_sample_stops_the_run(capsys, tmp_path, reward, message):
    code, printed, run_dir = _train(capsys, tmp_path, reward)
    assert code == 2, printed
    assert "Traceback" not in printed
    lines = printed.splitlines()
    # the first message once, though all 3 x 4 samples failed with it
    assert lines.count(f"reward error at step 1 (first of its kind, not repeated): {message}") == 1
    assert sum(message in line for line in lines) == 2  # that line and the final error
    warnings = [line for line in lines if line.startswith("warning: step ")]
    assert warnings == [
        f"warning: step {n}: the reward failed on all 4 samples, so the step learned nothing "
        f"({n} of 3 in a row before the run stops)" for n in (1, 2, 3)
    ]
    assert lines[-1] == (
        f"error: the reward failed on every sample of 3 steps in a row (steps 1-3), so the run "
        f"stopped: {message}. Fix the reward function (samples.jsonl has each sample's error), "
        f"or raise `train.max_reward_error_steps` (0 never stops)"
    )
    # what the 3 steps wrote is kept, and a checkpoint of where the run stopped
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3]
    assert _steps(run_dir / "samples.jsonl") == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step-3" / "COMPLETE").is_file()


@pytest.mark.parametrize("ahead", [(), ("runtime.max_staleness=1", "algo.importance_correction=token-truncate")],
                         ids=["in-turn", "ahead"])
def test_a_reward_failing_on_every_sample_stops_a_run_that_drops_groups(capsys, tmp_path, ahead):
    """Dynamic sampling drops every group (no valid reward, no spread), and the errors of
    the dropped groups are still the step's: shown, counted, and stopping the run, also
    when the batches are generated ahead of the learner."""
    code, printed, _ = _train(capsys, tmp_path, "high", "algo.dynamic_sampling=true", "algo.max_refill_rounds=0",
                              *ahead)
    assert code == 2, printed
    message = "high: returned str 'high' (expected a finite number)"
    assert f"reward error at step 1 (first of its kind, not repeated): {message}" in printed
    assert printed.splitlines()[-1].startswith(
        f"error: the reward failed on every sample of 3 steps in a row (steps 1-3), so the run stopped: {message}."
    )


def test_zero_never_stops(capsys, tmp_path):
    code, printed, run_dir = _train(capsys, tmp_path, "high", "train.max_reward_error_steps=0")
    assert code == 0, printed
    assert printed.count("warning: step ") == 5
    assert "(train.max_reward_error_steps=0: the run goes on)" in printed
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4, 5]


def test_a_reward_failing_on_some_samples_shows_the_count_and_trains_on(capsys, tmp_path):
    code, printed, run_dir = _train(capsys, tmp_path, "some")
    assert code == 0, printed
    # 20 calls: 5 raise (1, 5, ..., 17), 5 return None (3, 7, ..., 19)
    assert printed.count("(first of its kind, not repeated)") == 2
    assert "reward error at step 1 (first of its kind, not repeated): some: ValueError: cannot parse call 1" in printed
    assert "reward error at step 1 (first of its kind, not repeated): some: returned None" in printed
    assert "warning: " not in printed
    bar = [line for line in printed.splitlines() if line.startswith("step 5/5")]
    assert len(bar) == 1 and "  errors 2  " in bar[0], printed  # the last step: calls 17 and 19
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward/errors"] for m in metrics if "reward/errors" in m] == [2.0] * 5
