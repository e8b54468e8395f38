"""A GRPO run on the tiny model whose learner takes the decode's products for its forward
(``train.reuse_rollout_mb``, on by default in a local run) is the run that computes them:
the same rewards, losses and gradient norms step by step, over several micro-batches a
step. The kept products are the same dot products as the learner's own, summed in the
decode's order (~1e-6 relative on log-probs and gradients, see
tests/unit/rollout/test_forward_replay.py), so the two runs sample the same completions
and their metrics agree to float32 rounding: rel 1e-6 with an absolute floor of 1e-6 for
losses that cancel to near 0 (a mean of O(1) terms, moved by a few float32 eps of the
terms' size). Measured: the rewards, entropies and losses equal to the bit, the gradient
norms at most 3.3e-7 apart (relative). A replayed row matched to the wrong recorded row,
or a stale record after an update, moves the loss by orders of magnitude more."""

from __future__ import annotations

import pytest

from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.usefixtures("keep_torch_threads")
RUN = ["train.steps=3", "train.threads=1", "train.micro_batch_tokens=64"]


def test_a_run_on_the_decodes_products_is_the_run_that_computes_them(tiny_grpo_config) -> None:
    reused = train(build_run(tiny_grpo_config(*RUN, "name=reused")))
    computed = train(build_run(tiny_grpo_config(*RUN, "name=computed", "train.reuse_rollout_mb=0")))
    assert [m["learn/replayed_frac"] for m in reused] == [1.0, 1.0, 1.0]
    assert all("learn/replayed_frac" not in m for m in computed)
    for step, (a, b) in enumerate(zip(reused, computed, strict=True)):
        keys = [k for k in b if k.startswith(("reward/", "loss", "grad_norm")) and isinstance(b[k], float)]
        assert "grad_norm" in keys and "loss" in keys, sorted(b)
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), (step, key)
