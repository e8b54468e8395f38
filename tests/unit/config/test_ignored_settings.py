"""Settings that this run would not read are refused when set away from their defaults
(a recipe may still spell a default out): the vLLM engine's keys without that engine, the
producer thread's cores without a producer thread, and the cosine schedule's floor on a constant schedule. Checked when a run
starts (``setting_problems``), so a saved config that holds one still loads."""

from __future__ import annotations

import pytest

from rltune.algos import ALGORITHMS
from rltune.config import ConfigError, load_config
from rltune.config.ignored import ray_keys_note, ray_threads_note
from rltune.runtime.build import setting_problems

BASE = ["reward.0.fn=m:f"]


def config(*overrides: str):
    """The config, refused as a run's start refuses it."""
    cfg = load_config(None, [*BASE, *overrides])
    if problems := setting_problems(ALGORITHMS[cfg.algo.name], cfg):
        raise ConfigError("; ".join(problems))
    return cfg


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.vllm.gpu_memory_utilization=0.9"],
     r"rollout.vllm.gpu_memory_utilization=0.9 needs rollout.engine=vllm: it configures the vLLM engine, and "
     r"rollout.engine=hf starts none; set rollout.engine: vllm, or remove it$"),
    (["rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=256"],
     r"rollout.vllm.max_model_len=256 and rollout.vllm.enforce_eager=True need rollout.engine=vllm: they "
     r"configure the vLLM engine, .* or remove them$"),
    (["rollout.vllm.engine_args.enable_prefix_caching=true"],
     r"rollout.vllm.engine_args=\{'enable_prefix_caching': True\} needs rollout.engine=vllm"),
])
def test_vllm_keys_without_the_vllm_engine_are_refused(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


def test_vllm_keys_at_their_defaults_or_with_the_vllm_engine_are_accepted() -> None:
    spelled = config("rollout.vllm.gpu_memory_utilization=0.5", "rollout.vllm.enforce_eager=false")
    assert spelled.rollout.engine == "hf"
    vllm = config("rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.9")
    assert vllm.rollout.vllm.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(("overrides", "message"), [
    ([], r"rollout.threads=2 is the generator's share .*; this run generates in the learner's thread: "
         r"use train.threads instead, and remove rollout.threads$"),
    (["runtime.mode=ray"], r"rollout.threads=2 .*; on Ray the generators use the CPUs they reserve "
                           r"\(runtime.placement.generator.cpus\): remove it$"),
])
def test_rollout_threads_without_a_producer_thread_are_refused(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config("rollout.threads=2", *overrides)


def test_rollout_threads_with_rollouts_ahead_of_the_learner_are_accepted() -> None:
    ahead = config("rollout.threads=2", "runtime.max_staleness=1", "algo.importance_correction=token-truncate")
    assert ahead.rollout.threads == 2


def test_environment_keys_without_an_environment_are_accepted() -> None:
    """env.name=null turns a recipe's environment off; its other keys may stay."""
    assert config("env.max_turns=2", "env.kwargs.a=1").env.name is None


def test_min_lr_ratio_on_a_constant_schedule_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train.min_lr_ratio=0.1 is where the cosine schedule ends; "
                                          r"train.schedule is constant: set schedule: cosine, or min_lr_ratio: 0"):
        config("train.min_lr_ratio=0.1")
    assert config("train.min_lr_ratio=0").train.schedule == "constant"
    assert config("train.schedule=cosine", "train.min_lr_ratio=0.1").train.min_lr_ratio == 0.1


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.weight_sync=broadcast"],
     "note: runtime.weight_sync=broadcast configures Ray's actors; runtime.mode=local runs every role in this "
     "process and reads it"),
    (["runtime.placement.learners=2", "runtime.placement.learner.gpus=1", "runtime.ray_address=auto",
      "runtime.learner_restarts=0"],
     "note: runtime.ray_address=auto and runtime.placement.learners=2 and runtime.placement.learner.gpus=1.0 and "
     "runtime.learner_restarts=0 configure Ray's actors; runtime.mode=local runs every role in this process and "
     "reads none of them"),
])
def test_ray_keys_in_a_local_run_are_a_note_not_a_refusal(overrides, message) -> None:
    """A Ray run's config run locally (to debug it, or to compare the two) is common."""
    cfg = config(*overrides)  # not refused
    assert ray_keys_note(cfg) == message


def test_ray_keys_at_their_defaults_or_on_ray_say_nothing() -> None:
    assert ray_keys_note(config("runtime.actor_restarts=3", "runtime.placement.learners=1")) is None
    ray = config("runtime.mode=ray", "runtime.placement.learners=2", "runtime.weight_sync=broadcast")
    assert ray_keys_note(ray) is None


def test_train_threads_on_ray_is_a_note_that_it_sets_the_drivers_threads_only() -> None:
    cfg = config("runtime.mode=ray", "train.threads=4", "runtime.placement.learner.cpus=2")
    assert ray_threads_note(cfg) == (
        "note: train.threads=4 sets the torch threads of this process (the driver) only; on Ray each actor runs as "
        "many threads as it reserves CPUs (the learners: runtime.placement.learner.cpus=2)")
    assert ray_threads_note(config("runtime.mode=ray")) is None
    assert ray_threads_note(config("train.threads=4")) is None  # a local run's learner uses them
