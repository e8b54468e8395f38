"""Exact resume of the run with the most state: PPO with LoRA adapters on the policy, a
critic with its own optimizer, the KL in the reward under the adaptive controller, two
shuffled mini-batches per epoch and two epochs. 4 steps straight equal 2 steps, a stop
and 2 more, bit for bit; and a resume that drops the critic's state does not."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.runtime.local import LocalTrained, build_run
from rltune.runtime.loop import Run, train

STEPS, STOP_AT = 4, 2
CONFIG = (
    "algo.name=ppo",
    f"train.steps={STEPS}",
    "train.prompts_per_step=4",
    "algo.group_size=4",
    "rollout.max_new_tokens=6",
    "train.lr=1e-3",
    "algo.critic_lr=3e-3",
    "algo.epochs=2",
    "algo.minibatches=2",
    "algo.kl_coef=0.05",
    "algo.kl_in_reward=true",
    "algo.kl_target=0.01",
    "algo.kl_horizon=100",
    "model.lora.r=4",
    f"checkpoint.every={STOP_AT}",
    "checkpoint.resume=auto",
    "train.threads=1",
)

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


def _deterministic(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "perf/")) and k not in ("samples_per_s", "tokens_per_s")}


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    a, b = _deterministic(a), _deterministic(b)
    return a.keys() == b.keys() and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in ((a[k], b[k]) for k in a)
    )


def _states_equal(x: Run, y: Run) -> bool:
    pairs = [(x.learner.model, y.learner.model), (x.roles.critic.model, y.roles.critic.model)]
    return all(
        all(torch.equal(sx[k], sy[k]) for k in sx)
        for sx, sy in ((m.state_dict(), n.state_dict()) for m, n in pairs)
    )


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory, tiny_grpo_config_at):
    root = tmp_path_factory.mktemp("ppo-resume")
    a = build_run(tiny_grpo_config_at(root / "a", *CONFIG))
    a_hist = train(a)
    cfg_b = tiny_grpo_config_at(root / "b", *CONFIG)
    b_first = train(build_run(cfg_b), stop_after=STOP_AT)
    b = build_run(cfg_b)
    b_second = train(b)
    return a, a_hist, b, b_first + b_second


def test_ppo_lora_resume_is_exact(straight_and_resumed):
    a, a_hist, b, b_hist = straight_and_resumed
    assert len(b_hist) == STEPS and b.step == STEPS
    for step, (x, y) in enumerate(zip(a_hist, b_hist), 1):
        assert _same(x, y), (step, _deterministic(x), _deterministic(y))
    assert _states_equal(a, b)
    assert a.roles.kl.coef == b.roles.kl.coef != 0.05  # the controller moved, and resumed where it was
    # 2 epochs x 2 mini-batches: four policy updates per step
    assert a.learner.version == b.learner.version == 4 * STEPS


def test_resume_without_the_critic_state_differs(straight_and_resumed, tmp_path, tiny_grpo_config_at, monkeypatch):
    a, a_hist, _, _ = straight_and_resumed
    cfg = tiny_grpo_config_at(tmp_path / "c", *CONFIG)
    train(build_run(cfg), stop_after=STOP_AT)
    load = LocalTrained.load_checkpoint_state

    def skip_critic(role, tensors, meta, path, prefix):
        if prefix != "critic_":
            load(role, tensors, meta, path, prefix)

    monkeypatch.setattr(LocalTrained, "load_checkpoint_state", skip_critic)
    c = build_run(cfg)
    train(c)
    assert not _states_equal(a, c)
