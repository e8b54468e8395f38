"""Exact resume of a GRPO run on the tiny model.

Run A trains 6 steps straight. Run B (same config, its own log dir) stops after step 3
with a checkpoint, as a preempted job would, and a fresh ``build_run`` of the same config
with ``checkpoint.resume=auto`` trains it to the end. B must be A, bit for bit: metrics,
samples and final parameters. The config exercises every piece of state a checkpoint
carries: a cosine schedule with warm-up (the lr of steps 4-6 depends on the restored
step count), a shuffled sampler mid-epoch (6 prompts per step out of 80), the sampling
RNG, AdamW's moments.

The controls show the comparison can fail: resuming with any one piece of state left
unrestored gives a different run, and a resume with another seed is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import rltune.runtime.state as run_state
from rltune.checkpoint.store import MARKER, CheckpointError, load_checkpoint, save_checkpoint
from rltune.config import ConfigError
from rltune.data.sampler import PromptSampler
from rltune.models.load import load_model, resolve_model
from rltune.runtime.local import build_run
from rltune.runtime.loop import Run, train

STEPS, STOP_AT = 6, 3
RESUME_CONFIG = (
    f"train.steps={STEPS}",
    "train.prompts_per_step=6",  # 80 train rows: never a whole epoch per step
    "algo.group_size=4",
    "rollout.max_new_tokens=6",
    "train.lr=1e-3",
    "train.schedule=cosine",
    "train.warmup_steps=2",
    "train.min_lr_ratio=0.1",
    "data.shuffle=true",
    "model.dtype=float32",
    "train.precision=fp32",
    f"checkpoint.every={STOP_AT}",
    "checkpoint.keep=2",
    "checkpoint.resume=auto",
    "train.threads=1",  # tiny matrices: one thread is faster, and steady on a busy machine
)
TIMING_KEYS = ("samples_per_s", "tokens_per_s")

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


@dataclass
class Runs:
    a: Run
    a_history: list[dict[str, float]]
    b: Run
    b_first: list[dict[str, float]]
    b_second: list[dict[str, float]]
    at_stop: Path
    """A copy of B's run directory as it was when B stopped at step 3."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_grpo_config_at) -> Runs:
    root = tmp_path_factory.mktemp("resume")
    run_a = build_run(tiny_grpo_config_at(root / "a", *RESUME_CONFIG))
    a_history = train(run_a)

    cfg_b = tiny_grpo_config_at(root / "b", *RESUME_CONFIG)
    first_b = build_run(cfg_b)
    b_first = train(first_b, stop_after=STOP_AT)
    at_stop = root / "b-at-stop"
    shutil.copytree(first_b.run_dir, at_stop)
    run_b = build_run(cfg_b)  # a new process would build exactly this
    b_second = train(run_b)
    return Runs(run_a, a_history, run_b, b_first, b_second, at_stop)


def _deterministic(metrics: dict[str, float]) -> dict[str, float]:
    """Every metric except wall-clock and process-state ones (``time/``, ``perf/``)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "perf/")) and k not in TIMING_KEYS}


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    """Exact equality of the deterministic metrics (NaN equals NaN)."""
    a, b = _deterministic(a), _deterministic(b)
    if a.keys() != b.keys():
        return False
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in
               ((a[k], b[k]) for k in a))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same_params(x: Run, y: Run) -> bool:
    sx, sy = x.learner.model.state_dict(), y.learner.model.state_dict()
    return sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


# --------------------------------------------------------------------------- exact resume


def test_resumed_run_continues_from_the_checkpoint(runs):
    assert len(runs.a_history) == STEPS
    assert len(runs.b_first) == STOP_AT
    assert len(runs.b_second) == STEPS - STOP_AT  # it resumed, it did not start over
    assert runs.b.step == STEPS and runs.b.learner.version == STEPS


def test_metrics_of_every_step_are_identical(runs):
    b_history = runs.b_first + runs.b_second
    for step, (a, b) in enumerate(zip(runs.a_history, b_history), 1):
        assert _same_metrics(a, b), (step, _deterministic(a), _deterministic(b))


def test_resumed_lr_follows_the_warmup_cosine_schedule(runs):
    # lr of optimizer step s (0-based) with warm-up 2 over 6 steps, peak 1e-3, floor 0.1:
    # warm-up (s+1)/3, then 0.1 + 0.9 * (1 + cos(pi * (s-2)/4)) / 2
    expected = [1e-3 / 3, 2e-3 / 3] + [
        1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4))) for s in range(2, 6)
    ]
    got = [m["lr"] for m in runs.b_first + runs.b_second]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_metrics_file_has_each_step_once(runs):
    a_records = _jsonl(runs.a.run_dir / "metrics.jsonl")
    b_records = _jsonl(runs.b.run_dir / "metrics.jsonl")
    assert [r["step"] for r in b_records] == list(range(1, STEPS + 1))
    for a, b in zip(a_records, b_records):
        assert _same_metrics(a, b), (a["step"], a, b)


def test_samples_files_are_identical(runs):
    a_samples = _jsonl(runs.a.run_dir / "samples.jsonl")
    b_samples = _jsonl(runs.b.run_dir / "samples.jsonl")
    # 6 prompts x 4 samples per step, every step once, in order
    assert [s["step"] for s in b_samples] == [step for step in range(1, STEPS + 1) for _ in range(24)]
    assert b_samples == a_samples


def test_final_state_is_bitwise_equal(runs):
    sa, sb = runs.a.learner.model.state_dict(), runs.b.learner.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    oa, ob = runs.a.learner.learner.optimizer.state_dict(), runs.b.learner.learner.optimizer.state_dict()
    for index, state in oa["state"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, ob["state"][index][key]), (index, key)
    assert runs.a.learner.learner.schedule.state_dict() == runs.b.learner.learner.schedule.state_dict()
    assert runs.a.data.sampler.state_dict() == runs.b.data.sampler.state_dict()
    assert torch.equal(
        runs.a.progress.streams.generators["sampling"].get_state(), runs.b.progress.streams.generators["sampling"].get_state()
    )


def test_training_changed_the_parameters(runs):
    """Equal final parameters mean something only if training moved them."""
    initial = load_model(resolve_model(runs.a.cfg.model.path), dtype="float32").state_dict()
    final = runs.a.learner.model.state_dict()
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


# --------------------------------------------------------------------------- controls


def _resume_from_stop(runs: Runs, root: Path, make, *overrides: str) -> Run:
    """A fresh run whose directory is B's as it was at the stop."""
    cfg = make(root, *RESUME_CONFIG, *overrides)
    shutil.copytree(runs.at_stop, Path(cfg.log.dir) / cfg.name)
    return build_run(cfg)


def _skip_optimizer(monkeypatch):
    monkeypatch.setattr(run_state, "optimizer_from_state", lambda *args, **kwargs: None)


def _skip_schedule(monkeypatch):
    monkeypatch.setattr(run_state, "scheduler_from_state", lambda *args, **kwargs: None)


def _skip_rng(monkeypatch):
    monkeypatch.setattr(run_state, "rng_from_state", lambda *args, **kwargs: None)


def _skip_sampler(monkeypatch):
    monkeypatch.setattr(PromptSampler, "load_state_dict", lambda self, state: None)


@pytest.mark.parametrize(
    "skip", [_skip_optimizer, _skip_schedule, _skip_rng, _skip_sampler],
    ids=["optimizer", "schedule", "rng", "sampler"],
)
def test_resume_without_one_piece_of_state_differs(runs, tmp_path, tiny_grpo_config_at, monkeypatch, skip):
    skip(monkeypatch)
    run = _resume_from_stop(runs, tmp_path, tiny_grpo_config_at)
    history = train(run)
    assert run.step == STEPS and len(history) == STEPS - STOP_AT  # the checkpoint was used
    same_metrics = all(_same_metrics(a, b) for a, b in zip(runs.a_history[STOP_AT:], history))
    same_samples = _jsonl(run.run_dir / "samples.jsonl") == _jsonl(runs.a.run_dir / "samples.jsonl")
    assert not (same_metrics and same_samples and _same_params(runs.a, run))


def test_resume_with_another_seed_is_refused(runs, tmp_path, tiny_grpo_config_at):
    with pytest.raises(ConfigError, match=r"this config differs from the run's .* means: train\.seed: 0 -> 1; "):
        _resume_from_stop(runs, tmp_path, tiny_grpo_config_at, "train.seed=1")


def test_resume_of_a_bare_checkpoint_with_another_seed_is_refused(runs, tmp_path, tiny_grpo_config_at):
    """Without the run's config.yaml to compare with, the config the checkpoint recorded
    refuses the other seed before anything loads, naming the key; a checkpoint without
    that record (rewritten here without it) is refused by its own sampler state."""
    shutil.copytree(runs.at_stop / "checkpoints", tmp_path / "bare")
    step = tmp_path / "bare" / "step-3"
    cfg = tiny_grpo_config_at(tmp_path, *RESUME_CONFIG, "train.seed=1", f"checkpoint.resume={step}")
    with pytest.raises(ConfigError, match=rf"differs from the one recorded in checkpoint {step} .*train\.seed: 0 -> 1"):
        build_run(cfg)
    tensors, meta = load_checkpoint(step)
    del meta["config"]
    unrecorded = save_checkpoint(tmp_path / "unrecorded", 3, tensors=tensors, meta=meta, keep=1)
    cfg = tiny_grpo_config_at(tmp_path, *RESUME_CONFIG, "train.seed=1", f"checkpoint.resume={unrecorded}", "name=u")
    run = build_run(cfg)
    with pytest.raises(CheckpointError, match=r"step-3: sampler state was saved with seed=0 but this run has seed=1 \(train\.seed\)"):
        train(run)


def test_a_checkpoint_whose_state_lacks_a_key_is_named(runs, tmp_path, tiny_grpo_config_at):
    """A state.json edited together with its checksum verifies but lacks what the run
    restores: one CheckpointError naming the checkpoint and the key, not a KeyError."""
    shutil.copytree(runs.at_stop / "checkpoints", tmp_path / "edited")
    step = tmp_path / "edited" / "step-3"
    (step / "state.json").write_text("{}")
    marker = json.loads((step / MARKER).read_text())
    marker["files"]["state.json"] = hashlib.sha256(b"{}").hexdigest()
    (step / MARKER).write_text(json.dumps(marker))
    run = build_run(tiny_grpo_config_at(tmp_path, *RESUME_CONFIG, f"checkpoint.resume={step}"))
    with pytest.raises(CheckpointError, match=rf"checkpoint {step} has no '\w+' in its state; it was not written by"):
        train(run)


def test_checkpoint_without_marker_is_ignored(runs, tmp_path, tiny_grpo_config_at):
    """An interrupted save (``step-99`` without ``COMPLETE``) is skipped by ``resume=auto``:
    the run continues from the newest complete checkpoint, A's ``step-6``."""
    cfg = tiny_grpo_config_at(tmp_path, *RESUME_CONFIG)
    checkpoints = Path(cfg.log.dir) / cfg.name / "checkpoints"
    shutil.copytree(runs.a.run_dir / "checkpoints", checkpoints)
    shutil.copytree(checkpoints / f"step-{STEPS}", checkpoints / "step-99")
    (checkpoints / "step-99" / MARKER).unlink()
    run = build_run(cfg)
    restored = run_state.restore(run)
    assert restored.path == checkpoints / f"step-{STEPS}" and restored.step == STEPS
    assert run.step == STEPS and run.learner.version == STEPS
    assert _same_params(runs.a, run)
    # named, and moved aside rather than deleted
    assert [(s.path, s.moved_to) for s in restored.skipped] == [
        (checkpoints / "step-99", checkpoints / ".skipped-step-99-no-marker")]
    assert (checkpoints / ".skipped-step-99-no-marker" / "model.safetensors").is_file()
    assert not (checkpoints / "step-99").exists()


def test_checkpoint_with_marker_is_not_ignored(runs, tmp_path, tiny_grpo_config_at):
    """Control for the test above: with its marker, ``step-99`` is the one tried first (and
    refused, since its marker records step 6: moved aside as corrupt)."""
    cfg = tiny_grpo_config_at(tmp_path, *RESUME_CONFIG)
    checkpoints = Path(cfg.log.dir) / cfg.name / "checkpoints"
    shutil.copytree(runs.a.run_dir / "checkpoints", checkpoints)
    shutil.copytree(checkpoints / f"step-{STEPS}", checkpoints / "step-99")
    run = build_run(cfg)
    restored = run_state.restore(run)
    assert [s.moved_to.name for s in restored.skipped] == [".skipped-step-99-corrupt"]
    assert "directory says step 99 but COMPLETE says 6" in restored.skipped[0].reason
    assert run.step == STEPS and (checkpoints / ".skipped-step-99-corrupt" / MARKER).is_file()
