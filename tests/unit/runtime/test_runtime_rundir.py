"""What a resume may change and what it may not (``rltune/runtime/rundir.py``), and the
checks on the run directory, without training: a saved ``config.yaml`` and a new config."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from rltune.config import ConfigError, load_config, save_resolved_config
from rltune.runtime.rundir import prepare_run_dir

BASE = ("algo.name=grpo", "reward.0.fn=rewards/mine.py:score", "train.steps=4", "name=r")


def _saved(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "runs" / "r"
    save_resolved_config(load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}", *overrides]), run_dir)
    return run_dir


def _resume(tmp_path: Path, run_dir: Path, *overrides: str) -> None:
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}", "checkpoint.resume=auto", *overrides])
    assert prepare_run_dir(cfg, run_dir) is None


@pytest.mark.parametrize("change", [
    "train.steps=8", "train.threads=1", "train.micro_batch_tokens=512", "log.console=false",
    "checkpoint.every=2", "checkpoint.keep=5", "eval.every=2", "runtime.reward_workers=2",
    "runtime.placement.generators=2", "reward.0.fn=/elsewhere/rewards/mine.py:score",
    "train.activation_checkpointing=full", "train.compile=true", "train.logprob_chunk_tokens=256",
    "train.parallel.dp_shard=1", "train.reuse_rollout_mb=0", "algo.skip_zero_advantage=true",
    "rollout.compile=true",
])
def test_what_a_resume_may_change(tmp_path, change):
    _resume(tmp_path, _saved(tmp_path), change)


@pytest.mark.parametrize(("change", "named"), [
    ("train.seed=7", "train.seed: 0 -> 7"),
    ("train.lr=1e-4", "train.lr: 1e-05 -> 0.0001"),
    ("algo.group_size=4", "algo.group_size: 8 -> 4"),
    ("data.train=builtin:arith_small/train", "data.train: 'builtin:arith/train' -> 'builtin:arith_small/train'"),
    ("model.dtype=bfloat16", "model.dtype: 'float32' -> 'bfloat16'"),
    ("model.lora.r=4", "model.lora: None -> {'r': 4,"),
    ("reward.0.fn=rewards/other.py:score", "reward.0.fn: 'rewards/mine.py:score' -> 'rewards/other.py:score'"),
    ("reward.0.weight=2", "reward.0.weight: 1.0 -> 2.0"),
    ("rollout.temperature=0.5", "rollout.temperature: 1.0 -> 0.5"),
    ("eval.temperature=0.5", "eval.temperature: 0.0 -> 0.5"),
])
def test_what_a_resume_refuses_names_the_key(tmp_path, change, named):
    run_dir = _saved(tmp_path)
    with pytest.raises(ConfigError, match="this config differs from the run's") as err:
        _resume(tmp_path, run_dir, change)
    assert named in str(err.value)


def test_steps_of_a_cosine_schedule_are_its_meaning(tmp_path):
    run_dir = _saved(tmp_path, "train.schedule=cosine")
    with pytest.raises(ConfigError, match=r"train\.steps: 4 -> 8"):
        _resume(tmp_path, run_dir, "train.schedule=cosine", "train.steps=8")
    _resume(tmp_path, run_dir, "train.schedule=cosine", "log.console=false")


def test_a_new_run_needs_an_empty_directory(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}"])
    assert prepare_run_dir(cfg, run_dir) is None  # absent
    run_dir.mkdir(parents=True)
    assert prepare_run_dir(cfg, run_dir) is None  # empty
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=f"run directory {run_dir} already holds a run"):
        prepare_run_dir(cfg, run_dir)


def test_a_checkpoint_of_another_run_is_not_resumed_into_a_run(tmp_path):
    run_dir = _saved(tmp_path)
    other = tmp_path / "runs" / "other" / "checkpoints" / "step-2"
    other.mkdir(parents=True)
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}", f"checkpoint.resume={other}"])
    with pytest.raises(ConfigError, match=f"the run directory {run_dir} holds another run"):
        prepare_run_dir(cfg, run_dir)
    own = run_dir / "checkpoints" / "step-2"
    own.mkdir(parents=True)
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}", f"checkpoint.resume={own}"])
    assert prepare_run_dir(cfg, run_dir) is None


def test_a_checkpoint_path_that_does_not_exist_is_named_as_such(tmp_path):
    run_dir = _saved(tmp_path)
    missing = tmp_path / "nowhere" / "step-2"
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}", f"checkpoint.resume={missing}"])
    with pytest.raises(ConfigError, match=f"checkpoint.resume={missing}: no such checkpoint directory"):
        prepare_run_dir(cfg, run_dir)


def test_a_log_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'afile' / 'runs'}"])
    with pytest.raises(ConfigError, match=f"log.dir: {tmp_path / 'afile'} is a file, not a directory"):
        prepare_run_dir(cfg, tmp_path / "afile" / "runs" / "r")


def test_resume_auto_without_a_checkpoint_moves_recorded_steps_aside(tmp_path):
    """A run that stopped before its first checkpoint starts again from step 0; what it
    recorded is moved aside whole, never written over. A directory with only its
    config (stopped before a step) is started in place."""
    run_dir = _saved(tmp_path)
    cfg = load_config(None, [*BASE, f"log.dir={tmp_path / 'runs'}", "checkpoint.resume=auto"])
    assert prepare_run_dir(cfg, run_dir) is None and (run_dir / "config.yaml").is_file()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "checkpoints" / "step-1").mkdir(parents=True)  # an unfinished save: no marker
    line = prepare_run_dir(cfg, run_dir)
    aside = tmp_path / "runs" / "r.old-1"
    assert line == (f"checkpoint.resume=auto: {run_dir} holds no complete checkpoint to continue from; "
                    f"moved what its earlier attempt wrote aside to {aside}; starting from step 0")
    assert not run_dir.exists() and (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (aside / "checkpoints" / "step-1").is_dir()


def test_a_key_the_algorithm_never_read_may_be_dropped_on_resume(tmp_path):
    """A run saved with a key its algorithm ignores (accepted then, refused now) resumes
    without it: the value was never part of what the run means."""
    run_dir = _saved(tmp_path, "algo.critic_lr=0.003")  # grpo has no critic
    _resume(tmp_path, run_dir)
    with pytest.raises(ConfigError, match=r"train.seed: 0 -> 3"):  # what it reads still counts
        _resume(tmp_path, run_dir, "train.seed=3")


@pytest.mark.parametrize("ignored", [
    "rollout.vllm.max_model_len=256",  # the hf engine starts no vLLM
    "env.max_turns=2",  # no environment
    "train.min_lr_ratio=0.1",  # a constant schedule
])
def test_a_setting_the_run_never_read_may_be_dropped_on_resume(tmp_path, ignored):
    """Settings refused now where a run does not read them (rltune.config.ignored) were
    accepted before: such a run's config still loads, and it resumes without them."""
    run_dir = _saved(tmp_path, ignored)
    _resume(tmp_path, run_dir)


def test_a_vllm_run_resumes_on_the_hf_engine_without_its_vllm_keys(tmp_path):
    """rollout.engine may change on a resume, and the hf engine refuses vLLM's keys: they
    may then be dropped (and given again when the engine becomes vllm once more)."""
    run_dir = _saved(tmp_path, "rollout.engine=vllm", "rollout.vllm.max_model_len=256")
    _resume(tmp_path, run_dir, "rollout.engine=hf")
    with pytest.raises(ConfigError, match=r"rollout.vllm.max_model_len: 256 -> 512"):  # both read it
        _resume(tmp_path, run_dir, "rollout.engine=vllm", "rollout.vllm.max_model_len=512")


def test_a_setting_the_run_reads_is_still_its_meaning(tmp_path):
    run_dir = _saved(tmp_path, "train.schedule=cosine", "train.min_lr_ratio=0.1")
    with pytest.raises(ConfigError, match=r"train.min_lr_ratio: 0.1 -> 0.0"):
        _resume(tmp_path, run_dir, "train.schedule=cosine")
    run_dir = _saved(tmp_path / "env", "env.name=envs.py:make", "env.max_turns=2")
    with pytest.raises(ConfigError, match=r"env.max_turns: 2 -> 4"):
        _resume(tmp_path / "env", run_dir, "env.name=envs.py:make")


def test_the_recorded_config_is_compared_after_the_same_json_round_trip(tmp_path):
    from rltune.runtime.rundir import check_recorded_meaning

    # a nested int dict key and a date come back from JSON as strings: still the same run
    cfg = load_config(None, [*BASE, "reward.0.kwargs={m: {1: 0.5}, when: 2024-01-01}"])
    assert cfg.reward[0].kwargs == {"m": {1: 0.5}, "when": datetime.date(2024, 1, 1)}
    check_recorded_meaning(cfg, cfg.model_dump(mode="json"), "checkpoint.resume=auto", tmp_path)
    other = load_config(None, [*BASE, "reward.0.kwargs={m: {1: 0.7}, when: 2024-01-01}"])
    with pytest.raises(ConfigError, match=r"differs from the one recorded in checkpoint .*reward.0.kwargs"):
        check_recorded_meaning(other, cfg.model_dump(mode="json"), "checkpoint.resume=auto", tmp_path)
