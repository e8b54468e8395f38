"""A run name used again never destroys the run that has it, a resume refuses a config
that means another run, and a resume says what it continues from, naming every
checkpoint it skipped (moved aside, not deleted).

One base run (3 steps, a checkpoint after each, its final export) is trained once; each
test works on a copy of its directory, through ``rltune train`` as a user would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rltune.cli import main
from cli_check import fails

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

NAME = "clob"
REWARD = "def digit_share(prompt, completion, **meta):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Keep each console message on one line for the assertions (rich wraps at 80)."""
    monkeypatch.setenv("COLUMNS", "500")


def _config(root: Path, reward_file: Path) -> Path:
    data = {
        "name": NAME,
        "model": {"path": "builtin:tiny"},
        "algo": {"name": "grpo", "group_size": 2},
        "data": {"train": "builtin:arith_small/train"},
        "reward": [{"fn": f"{reward_file}:digit_share"}],
        "rollout": {"max_new_tokens": 4},
        "train": {"steps": 3, "prompts_per_step": 2, "lr": 1e-3, "threads": 1},
        "log": {"dir": str(root / "runs"), "console": False},
        "checkpoint": {"every": 1, "keep": 3},
    }
    path = root / "base.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """The ``runs`` folder after ``rltune train base.yaml`` (3 steps, checkpoints 1-3)."""
    root = tmp_path_factory.mktemp("base")
    reward_file = root / "my_rewards.py"
    reward_file.write_text(REWARD)
    assert main(["train", str(_config(root, reward_file))]) == 0
    return root


@pytest.fixture
def work(base_run, tmp_path) -> Path:
    """A copy of the base run's ``runs`` folder for one test, with the base config writing
    there (its reward file stays the base run's: the same function, as a resume needs)."""
    shutil.copytree(base_run, tmp_path, dirs_exist_ok=True)
    config = yaml.safe_load((tmp_path / "base.yaml").read_text())
    config["log"]["dir"] = str(tmp_path / "runs")
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return tmp_path


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _train(capsys, work: Path, *overrides: str) -> str:
    code = main(["train", str(work / "base.yaml"), *overrides])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    return err


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_base_run_has_what_the_tests_rely_on(base_run):
    run_dir = base_run / "runs" / NAME
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2", "step-3"]
    assert _steps(run_dir) == [1, 2, 3]
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_a_reused_name_is_refused_and_the_old_run_is_untouched(capsys, work):
    run_dir = work / "runs" / NAME
    before = _tree(run_dir)
    err = fails(capsys, ["train", str(work / "base.yaml"), "train.steps=1", "train.seed=7"])
    assert f"run directory {run_dir} already holds a run" in err
    assert "another `name`" in err and "checkpoint.resume=auto" in err
    assert f"move it aside to {work / 'runs' / (NAME + '.old-1')}" in err and "checkpoint.overwrite=true" in err
    assert _tree(run_dir) == before
    assert sorted(p.name for p in (work / "runs").iterdir()) == [NAME]


def test_overwrite_moves_the_old_run_aside_whole(capsys, work):
    run_dir, aside = work / "runs" / NAME, work / "runs" / f"{NAME}.old-1"
    before = _tree(run_dir)
    err = _train(capsys, work, "train.steps=1", "train.seed=7", "checkpoint.overwrite=true")
    assert f"moved the old run in {run_dir} aside to {aside}" in err
    assert _tree(aside) == before  # every file of the old run, byte for byte
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1"]
    assert _steps(run_dir) == [1]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["seed"] == 7

    # a second overwrite takes the next free name; the first one moved aside stays
    _train(capsys, work, "train.steps=1", "checkpoint.overwrite=true")
    assert _tree(aside) == before
    assert _steps(work / "runs" / f"{NAME}.old-2") == [1]


def test_overwrite_with_resume_auto_is_a_config_error(capsys, work):
    err = fails(capsys, ["train", str(work / "base.yaml"), "checkpoint.overwrite=true", "checkpoint.resume=auto"])
    assert "cannot be combined with resume=auto" in err


def test_a_resume_refuses_a_config_that_means_another_run(capsys, work):
    run_dir = work / "runs" / NAME
    before = _tree(run_dir)
    err = fails(capsys, ["train", str(work / "base.yaml"), "checkpoint.resume=auto", "train.steps=4",
                         "train.seed=7", "algo.clip_high=0.3", "log.samples_per_step=1"])
    assert f"checkpoint.resume=auto: this config differs from the run's ({run_dir / 'config.yaml'})" in err
    assert "train.seed: 0 -> 7" in err and "algo.clip_high: 0.2 -> 0.3" in err
    assert "train.steps" not in err and "log.samples_per_step" not in err  # these may change
    assert _tree(run_dir) == before


def test_a_resume_says_where_it_continues_from(capsys, work):
    run_dir = work / "runs" / NAME
    err = _train(capsys, work, "checkpoint.resume=auto", "train.steps=4", "log.samples_per_step=1",
                 "checkpoint.keep=4")
    assert f"resuming from {run_dir / 'checkpoints' / 'step-3'} (step 3 of 4)" in err
    assert "skipped" not in err
    assert _steps(run_dir) == [1, 2, 3, 4]


def test_a_resume_skips_unfinished_and_corrupt_checkpoints_naming_them(capsys, work):
    run_dir = work / "runs" / NAME
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step-3" / "COMPLETE").unlink()  # a save interrupted before its marker
    weights = checkpoints / "step-2" / "model.safetensors"
    corrupted = bytearray(weights.read_bytes())
    corrupted[-1] ^= 0xFF
    weights.write_bytes(bytes(corrupted))
    step3, step2 = _tree(checkpoints / "step-3"), _tree(checkpoints / "step-2")

    err = " ".join(_train(capsys, work, "checkpoint.resume=auto", "train.steps=4", "checkpoint.keep=4").split())

    step1 = checkpoints / "step-1"
    assert (f"skipped checkpoint {checkpoints / 'step-3'} (no COMPLETE marker: its save did not finish); "
            f"moved it to {checkpoints / '.skipped-step-3-no-marker'}; resuming from {step1}") in err
    assert f"skipped checkpoint {checkpoints / 'step-2'} (model.safetensors has sha256" in err
    assert f"moved it to {checkpoints / '.skipped-step-2-corrupt'}; resuming from {step1}" in err
    assert f"resuming from {step1} (step 1 of 4)" in err
    # moved aside as they were, and the run continued from step 1 with new steps 2-4
    assert _tree(checkpoints / ".skipped-step-3-no-marker") == step3
    assert _tree(checkpoints / ".skipped-step-2-corrupt") == step2
    assert _steps(run_dir) == [1, 2, 3, 4]
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "step-1", "step-2", "step-3", "step-4"]


def test_a_resume_from_an_older_checkpoint_moves_the_newer_ones_aside(capsys, work):
    """Continuing from step 1 trains steps 2 and 3 again: the old ones are set aside, so a
    later ``resume=auto`` or ``rltune export`` cannot pick up the abandoned steps."""
    run_dir = work / "runs" / NAME
    checkpoints = run_dir / "checkpoints"
    old_step3 = _tree(checkpoints / "step-3")
    step1 = checkpoints / "step-1"
    err = " ".join(_train(capsys, work, f"checkpoint.resume={step1}").split())
    for n in (3, 2):
        assert (f"skipped checkpoint {checkpoints / f'step-{n}'} (newer than step-1, which checkpoint.resume "
                f"names); moved it to {checkpoints / f'.skipped-step-{n}-newer'}; resuming from {step1}") in err
    assert f"resuming from {step1} (step 1 of 3)" in err
    assert _tree(checkpoints / ".skipped-step-3-newer") == old_step3
    assert (checkpoints / "step-3" / "COMPLETE").is_file()  # written again by this run
    assert _steps(run_dir) == [1, 2, 3]
