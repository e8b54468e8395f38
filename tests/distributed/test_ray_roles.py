"""The reference model and PPO's critic are roles the Ray runtime places: a PPO run with a
KL term gets one reference actor and one critic actor, each in a bundle of its own (not
on the driver), and trains as the same run does in one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from rltune.config import load_config  # noqa: E402
from rltune.runtime.build import build_run as build_with_roles  # noqa: E402
from rltune.runtime.local import build_run  # noqa: E402
from rltune.runtime.loop import train  # noqa: E402
from rltune.runtime.ray.roles import RayCritic, RayReference, RayRoles, model_roles  # noqa: E402
from rltune.runtime.ray.run import place_run  # noqa: E402

REWARD = '''
def digit_share(prompt, completion, **meta):
    if not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)
'''


def ppo_config(tmp_path: Path, *overrides: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rewards.py").write_text(REWARD)
    return load_config(None, [
        "model.path=builtin:tiny", "algo.name=ppo", "algo.group_size=4", "algo.kl_coef=0.1",
        "algo.critic_lr=3e-3", "data.train=builtin:arith_small/train",
        f"reward.0.fn={tmp_path / 'rewards.py'}:digit_share", "rollout.max_new_tokens=6", "train.steps=2",
        "train.prompts_per_step=4", "train.lr=1e-3", "train.threads=1", f"log.dir={tmp_path / 'runs'}",
        "log.console=false", "checkpoint.final=false", *overrides,
    ])


def test_model_roles_follow_the_algorithm(tmp_path) -> None:
    assert model_roles(ppo_config(tmp_path)) == ("reference", "critic")
    assert model_roles(ppo_config(tmp_path, "algo.kl_coef=0")) == ("critic",)
    assert model_roles(ppo_config(tmp_path, "algo.name=grpo", "algo.kl_coef=0")) == ()


def test_ppo_with_kl_places_reference_and_critic_as_actors_and_matches_local(ray_cluster, tmp_path) -> None:
    # reuse off: a Ray generator is another process, whose products the learner cannot take
    local = train(build_run(ppo_config(tmp_path, "name=local", "train.reuse_rollout_mb=0")))
    cfg = ppo_config(tmp_path, "name=ray", "runtime.mode=ray")
    placement = place_run(cfg, name="test-ray-roles")
    roles = RayRoles(placement, None, Path(cfg.log.dir) / cfg.name)
    try:
        # a bundle each, after the learner's, generator's and scorer's
        assert placement.index["reference"] == [3] and placement.index["critic"] == [4]
        run = build_with_roles(cfg, roles)
        assert isinstance(run.roles.reference, RayReference) and isinstance(run.roles.critic, RayCritic)
        assert run.roles.reference.pool.call_all("pid")[0] != os.getpid()
        remote = train(run)
    finally:
        roles.close()
        placement.remove()
    # one generator actor samples with the local stream, every model starts from the same
    # weights, and every process (here and the actors) runs one torch thread: the same
    # floating-point operations in the same order, so the same numbers to the bit
    assert [_deterministic(m) for m in remote] == [_deterministic(m) for m in local]
    assert local[0]["kl"] == 0.0 < local[1]["kl"]  # the policy is the reference until it learns
    assert all(m["critic/loss"] > 0 for m in local)
    assert all(m["faults/generator_restarts"] == m["faults/scorer_restarts"] == 0 for m in remote)

def _ray_train(cfg, *, stop_after: int | None = None) -> tuple[list[dict], dict]:
    """Train ``cfg`` on Ray; returns the history and the critic actor's model state."""
    placement = place_run(cfg, name=f"test-{cfg.name}-{stop_after}")
    roles = RayRoles(placement, None, Path(cfg.log.dir) / cfg.name)
    try:
        run = build_with_roles(cfg, roles)
        history = train(run, stop_after=stop_after)
        tensors, _ = run.roles.critic.checkpoint_state("critic_")
    finally:
        roles.close()
        placement.remove()
    return history, tensors["critic_model"]


def _deterministic(row: dict) -> dict:
    """Every metric but the timings and the Ray pools' restart counts (a local run has none)."""
    return {k: v for k, v in row.items()
            if not k.startswith(("time/", "perf/", "samples_per_s", "tokens_per_s", "faults/"))}


@pytest.mark.slow
def test_ppo_on_ray_resumes_exactly_with_the_critic_actor(ray_cluster, tmp_path) -> None:
    """Stopped after step 1 and resumed, the run is the one that did not stop: the critic
    actor's model and optimizer came back from the checkpoint (a critic that started
    afresh would give other values, hence other advantages, at step 2)."""
    over = ("train.steps=3", "checkpoint.every=1", "checkpoint.resume=auto")
    straight, critic_a = _ray_train(ppo_config(tmp_path / "a", "name=a", *over))
    cfg = ppo_config(tmp_path / "b", "name=b", *over)
    first, _ = _ray_train(cfg, stop_after=1)
    rest, critic_b = _ray_train(cfg)
    assert [_deterministic(m) for m in first + rest] == [_deterministic(m) for m in straight]
    assert all(torch.equal(critic_a[k], critic_b[k]) for k in critic_a)
