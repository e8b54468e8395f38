"""GRPO on the tiny MoE model with routing replay and aux-free balancing: the run trains,
logs the router agreement and the generator's expert load every step, and the routing
bias it ends with is in the model's state."""

from __future__ import annotations

import math

import pytest
import torch

from rltune.models.routing import BIAS_BUFFER, find_routers
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")


def test_grpo_with_routing_replay_logs_router_agreement(tiny_grpo_config):
    """Generation and learning share the module and the learner steps once per batch,
    so the learner's router sees the weights that routed the samples: the agreement is
    near 1 (a near-tie can flip between a cached decode step and the full forward, so not
    asserted exactly 1). Over 3 steps at rate 0.01 every bias entry has moved by a
    multiple of the rate, at most 0.03."""
    cfg = tiny_grpo_config(
        "model.path=builtin:tiny-moe", "model.moe.routing_replay=rollout", "model.moe.aux_free_bias=0.01",
        "train.steps=3", "train.prompts_per_step=4", "algo.group_size=4", "train.threads=1",
    )
    run = build_run(cfg)
    history = train(run)
    assert len(history) == 3
    for m in history:
        assert 0.95 <= m["moe/router_agreement"] <= 1.0
        assert math.isfinite(m["loss"]) and m["gen/moe/load_max"] >= 1.0
    bias = torch.stack([g.routing_bias for g in find_routers(run.roles.learner.model)])
    assert bias.abs().max() <= 0.03 + 1e-6 and bias.abs().sum() > 0
    assert any(k.endswith(BIAS_BUFFER) for k in run.roles.learner.model.state_dict())


def test_router_agreement_is_logged_without_replay_too(tiny_grpo_config):
    """Routes are recorded for every MoE model on the HF generator; with replay off the
    learner routes by itself and still reports how often it agrees."""
    cfg = tiny_grpo_config("model.path=builtin:tiny-moe", "train.steps=1", "train.prompts_per_step=4",
                           "algo.group_size=4", "train.threads=1")
    history = train(build_run(cfg))
    assert 0.95 <= history[0]["moe/router_agreement"] <= 1.0


def test_a_resumed_run_keeps_the_routing_bias(tiny_grpo_config_at, tmp_path):
    """The bias is model state: a run stopped after step 1 with a checkpoint and resumed
    ends with the bias (and weights) of the run that did not stop, to the bit; a resume
    that lost the bias would restart it at 0 and differ by at least one rate step."""
    common = ("model.path=builtin:tiny-moe", "model.moe.routing_replay=rollout", "model.moe.aux_free_bias=0.01",
              "train.steps=2", "train.prompts_per_step=4", "algo.group_size=4", "train.threads=1",
              "checkpoint.every=1", "checkpoint.resume=auto")
    straight = build_run(tiny_grpo_config_at(tmp_path / "a", *common))
    train(straight)
    cfg_b = tiny_grpo_config_at(tmp_path / "b", *common)
    train(build_run(cfg_b), stop_after=1)
    resumed = build_run(cfg_b)
    train(resumed)
    a, b = straight.roles.learner.model.state_dict(), resumed.roles.learner.model.state_dict()
    keys = [k for k in a if k.endswith(BIAS_BUFFER)]
    assert keys and all(torch.equal(a[k], b[k]) for k in a)
