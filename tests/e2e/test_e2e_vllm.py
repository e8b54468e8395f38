"""GRPO with the vLLM generator (``rollout.engine: vllm``) in the local runtime: the
reward rises as it does with rltune's own sampler, and at every step the engine samples
with the learner's newest weights, loaded in place (its log-probs of the sampled tokens
match the learner's). Skipped, with the reason, where vLLM is not installed; ``make
test-vllm`` runs it on vLLM's CPU build."""

from __future__ import annotations

import statistics

import pytest

from rltune.rollout.vllm import vllm_missing
from rltune.runtime.local import build_run
from rltune.runtime.loop import train

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))


def test_grpo_on_vllm_learns_from_the_weights_it_was_given(tiny_grpo_config) -> None:
    cfg = tiny_grpo_config("rollout.engine=vllm", "rollout.vllm.max_model_len=128",
                           "rollout.vllm.engine_args.kv_cache_memory_bytes=268435456")
    history = train(build_run(cfg))
    curve = [m["reward/mean"] for m in history]
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    assert first < 0.3, curve
    assert last > first + 0.3, curve
    # the learner's log-probs of each step's samples, before its update, are the engine's:
    # the engine held that step's weights (a stale engine drifts by 1e-2 and more in a step)
    mismatch = [m["logprob_mismatch"] for m in history]
    assert max(mismatch) < 1e-3, mismatch


def test_a_vllm_run_resumes_exactly(tiny_grpo_config, tmp_path) -> None:
    """Run A trains 6 steps; run B stops after step 3 with a checkpoint and a new run of
    the same config resumes it: the engine is rebuilt from the model directory, takes the
    checkpoint's weights, and its sampling seeds come from the restored stream, so steps
    4-6 sample and learn as A's did."""
    common = ("rollout.engine=vllm", "rollout.vllm.max_model_len=128",
              "rollout.vllm.engine_args.kv_cache_memory_bytes=268435456", "train.steps=6",
              "checkpoint.every=3", "checkpoint.resume=auto")
    a = train(build_run(tiny_grpo_config(*common, f"log.dir={tmp_path / 'a'}")))
    b_cfg = tiny_grpo_config(*common, f"log.dir={tmp_path / 'b'}")
    b_first = train(build_run(b_cfg), stop_after=3)
    b_second = train(build_run(b_cfg))
    assert len(b_first) == len(b_second) == 3
    for key in ("reward/mean", "loss", "logprob_mismatch"):
        assert [m[key] for m in b_first + b_second] == [m[key] for m in a], key
