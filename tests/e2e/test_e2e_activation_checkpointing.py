"""A PPO run on the tiny model (policy and critic learners, the HF generator sharing the
policy's module) with every block checkpointed is the run without checkpointing: the
same rewards, losses and values step by step. The recompute is the same arithmetic
(bitwise on CPU for one block, tests/unit/learner/test_learner_memory.py) and generation
runs the plain forward, so the two runs sample the same completions and take the same
updates. Whole runs agree to float32 rounding rather than bit for bit (the entropies
differ by ~1e-7 relative), so the metrics are compared at rel 1e-6, with an absolute
floor of 1e-6 for those near 0 (below)."""

from __future__ import annotations

import pytest

from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")
RUN = ["algo.name=ppo", "algo.critic_lr=3e-3", "train.steps=3", "train.threads=1", "train.micro_batch_tokens=64"]


def test_ppo_with_full_checkpointing_is_the_plain_run(tiny_grpo_config) -> None:
    plain = train(build_run(tiny_grpo_config(*RUN, "name=plain")))
    checkpointed = train(build_run(tiny_grpo_config(*RUN, "name=checkpointed", "train.activation_checkpointing=full")))
    assert len(plain) == len(checkpointed) == 3
    for step, (a, b) in enumerate(zip(plain, checkpointed)):
        keys = [k for k in a if k.startswith(("reward/", "loss", "critic/", "grad_norm")) and isinstance(a[k], float)]
        assert keys and "critic/value_error" in keys, sorted(a)
        for key in keys:
            # A loss is a mean of O(1) terms (unit-std advantages times ratios near 1) that
            # can cancel to ~1e-8; the learner's float32 sums, in another order in the two
            # runs (the entropies differ by ~1e-7 relative), move it by a few float32 eps
            # (1.2e-7) of the terms' size, hence the 1e-6 floor. A wrong recompute moves
            # log-probs, and so every loss, by orders of magnitude more.
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), (step, key)
