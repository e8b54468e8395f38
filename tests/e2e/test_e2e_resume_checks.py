"""A resume refuses a checkpoint it cannot continue faithfully, before it cuts the run's
metrics and samples back or writes anything, with one CheckpointError naming the
checkpoint: a step in ``state.json`` other than the checkpoint's (a checksum does not
catch a ``state.json`` edited with its marker, or written by a faulty save), a checkpoint
past ``train.steps``, values of the wrong kind, a critic in a run without one, and a KL
reference that is no longer the weights at ``model.path`` the run started from.

One tiny GRPO run with a KL term (its reference loaded from a copy of the tiny model),
two steps with a checkpoint after each, is copied and damaged by each test."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rltune.checkpoint.model import frozen_fingerprint
from rltune.checkpoint.store import MARKER, CheckpointError
from rltune.config import Config
from rltune.models.load import resolve_model
from rltune.runtime.local import build_run, run_local
from rltune.runtime.loop import train
from rltune.runtime.resumable import REFERENCE
from rltune.runtime.roles import load_reference_model
from rltune.runtime.state import restore

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

CONFIG = (
    "train.steps=2",
    "train.prompts_per_step=2",
    "algo.group_size=2",
    "algo.kl_coef=0.04",
    "rollout.max_new_tokens=4",
    "train.schedule=constant",
    "checkpoint.every=1",
    "checkpoint.keep=3",
    "train.threads=1",
)


@pytest.fixture(scope="module")
def done(tmp_path_factory, tiny_grpo_config_at) -> Path:
    """The run directory of the finished two-step run (its model at ``ROOT/model``)."""
    root = tmp_path_factory.mktemp("checked")
    model = shutil.copytree(resolve_model("builtin:tiny"), root / "model")
    run = build_run(tiny_grpo_config_at(root, *CONFIG, f"model.path={model}"))
    train(run)
    return run.run_dir


def _resume(done: Path, tmp_path: Path, make, *overrides: str, model: Path | None = None):
    """The config of a resume (``checkpoint.resume=auto``) of a copy of ``done``; its run
    directory is ``tmp_path/runs/tiny-grpo``; ``model``: a copy of the run's model."""
    model = model or done.parent.parent / "model"
    cfg = make(tmp_path, *CONFIG, f"model.path={model}", "checkpoint.resume=auto", *overrides)
    shutil.copytree(done, Path(cfg.log.dir) / cfg.name)
    return cfg


def _edit_state(checkpoint: Path, edit) -> None:
    """Edit ``state.json`` and record its new checksum in the marker: the edit verifies."""
    meta = json.loads((checkpoint / "state.json").read_text())
    edit(meta)
    data = json.dumps(meta, indent=1).encode()
    (checkpoint / "state.json").write_bytes(data)
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"]["state.json"] = hashlib.sha256(data).hexdigest()
    (checkpoint / MARKER).write_text(json.dumps(marker))


def _records(run_dir: Path, *more: str) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "samples.jsonl", *more)}


def test_the_run_records_its_kl_reference(done):
    """The fingerprint of the weights at model.path, as the reference loads them."""
    meta = json.loads((done / "checkpoints" / "step-2" / "state.json").read_text())
    reference = load_reference_model(Config(), str(done.parent.parent / "model"))
    assert meta[REFERENCE] == frozen_fingerprint(reference)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(step=-1), "state.json has step -1, not a whole number >= 0"),
    (lambda m: m.update(step=100), "state.json says step 100 but COMPLETE says 2"),
    (lambda m: m.update(step=1), "state.json says step 1 but COMPLETE says 2"),
    (lambda m: m["learner"].update(version="abc"), "state.json's learner.version is 'abc', not a whole number"),
    (lambda m: m["optimizer"]["param_groups"][0].update(lr="fast"),
     r"state.json's optimizer.param_groups\[0\].lr is 'fast', not a number >= 0"),
    (lambda m: m["scheduler"].update(last_epoch=-5), "state.json's scheduler.last_epoch is -5"),
], ids=["step -1", "step 100", "step 1", "version", "lr", "schedule"])
def test_a_bad_state_is_refused_before_the_metrics_are_cut(done, tmp_path, tiny_grpo_config_at, edit, match):
    cfg = _resume(done, tmp_path, tiny_grpo_config_at)
    run_dir = Path(cfg.log.dir) / cfg.name
    checkpoint = run_dir / "checkpoints" / "step-2"
    _edit_state(checkpoint, edit)
    before = _records(run_dir)
    run = build_run(cfg)
    with pytest.raises(CheckpointError, match=rf"checkpoint {checkpoint}: {match}"):
        train(run)
    assert _records(run_dir) == before  # every step's metrics and samples are still there


def test_a_step_past_train_steps_does_not_rewrite_the_final_model(done, tmp_path, tiny_grpo_config_at):
    """``step: 100`` edited into both files (it verifies and agrees with its marker):
    refused as past ``train.steps``, and no final model is written from it."""
    cfg = _resume(done, tmp_path, tiny_grpo_config_at, "checkpoint.final=true")
    run_dir = Path(cfg.log.dir) / cfg.name
    checkpoint = run_dir / "checkpoints" / "step-2"
    _edit_state(checkpoint, lambda m: m.update(step=100))
    marker = json.loads((checkpoint / MARKER).read_text())
    (checkpoint / MARKER).write_text(json.dumps({**marker, "step": 100}))
    shutil.move(checkpoint, run_dir / "checkpoints" / "step-100")
    with pytest.raises(CheckpointError, match=r"step-100 is at step 100, past train.steps=2: there is nothing left"):
        run_local(cfg)
    assert not (run_dir / "final").exists()


def test_a_resume_with_train_steps_below_the_checkpoint_is_refused_before_writing(done, tmp_path, tiny_grpo_config_at):
    cfg = _resume(done, tmp_path, tiny_grpo_config_at, "train.steps=1", "checkpoint.final=true")
    run_dir = Path(cfg.log.dir) / cfg.name
    before = _records(run_dir, "config.yaml")
    with pytest.raises(CheckpointError, match=rf"checkpoint {run_dir / 'checkpoints' / 'step-2'} is at step 2, past "
                       r"train.steps=1: .* to continue the run set train.steps above 2; to write out its model use "
                       r"`rltune export RUN OUT --checkpoint"):
        run_local(cfg)
    assert _records(run_dir, "config.yaml") == before and not (run_dir / "final").exists()


def test_a_critic_without_its_config_record_is_refused(done, tmp_path, tiny_grpo_config_at):
    """A PPO checkpoint (its critic's state) without the config record that would name
    the algorithm: GRPO would resume it and drop the critic silently."""
    cfg = _resume(done, tmp_path, tiny_grpo_config_at)
    checkpoint = Path(cfg.log.dir) / cfg.name / "checkpoints" / "step-2"
    _edit_state(checkpoint, lambda m: (m.pop("config"), m.update(critic_learner=m["learner"])))
    run = build_run(cfg)
    with pytest.raises(CheckpointError, match=rf"checkpoint {checkpoint} holds a critic \(critic_learner\), which only "
                       r"an algorithm with a value model \(ppo\) writes; it was not written by a run of algo 'grpo'"):
        train(run)


def test_the_cuda_rng_mismatch_names_the_checkpoint(done, tmp_path, tiny_grpo_config_at):
    cfg = _resume(done, tmp_path, tiny_grpo_config_at)
    checkpoint = Path(cfg.log.dir) / cfg.name / "checkpoints" / "step-2"
    _edit_state(checkpoint, lambda m: m["rng"].update(cuda_devices=7))
    run = build_run(cfg)
    with pytest.raises(CheckpointError, match=rf"^{checkpoint}: the checkpoint holds CUDA RNG states for 7 device"):
        train(run)


def test_other_weights_at_model_path_are_refused_as_kl_reference(done, tmp_path, tiny_grpo_config_at):
    """``model.path`` rewritten between the save and the resume (a re-run of the stage
    before wrote there): the policy would continue from the checkpoint and the KL term
    would measure it against other weights."""
    model = Path(shutil.copytree(done.parent.parent / "model", tmp_path / "model"))
    cfg = _resume(done, tmp_path, tiny_grpo_config_at, model=model)
    run_dir = Path(cfg.log.dir) / cfg.name
    for checkpoint in (run_dir / "checkpoints").iterdir():  # the record says this model.path
        _edit_state(checkpoint, lambda m: m["config"]["model"].update(path=str(model)))
    saved = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(saved.replace(str(done.parent.parent / "model"), str(model)))
    assert restore(build_run(cfg))  # the control: the same weights resume
    weights = load_file(model / "model.safetensors")
    save_file({k: v + 0.01 * torch.randn_like(v) for k, v in weights.items()}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    before = _records(run_dir)
    run = build_run(cfg)
    with pytest.raises(CheckpointError, match=rf"step-2: the KL reference loaded from model.path={model} is not the "
                       r"one the run started from"):
        train(run)
    assert _records(run_dir) == before


def test_a_checkpoint_from_before_the_reference_record_resumes_with_a_note(done, tmp_path, tiny_grpo_config_at):
    cfg = _resume(done, tmp_path, tiny_grpo_config_at)
    checkpoint = Path(cfg.log.dir) / cfg.name / "checkpoints" / "step-2"
    _edit_state(checkpoint, lambda m: m.pop(REFERENCE))
    restored = restore(build_run(cfg))
    assert restored.path == checkpoint
    assert restored.lines(2)[-1].startswith(f"note: checkpoint {checkpoint} records no fingerprint of the KL reference")
